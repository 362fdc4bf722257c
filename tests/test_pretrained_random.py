"""Tiny random BERT checkpoints saved by transformers load onto handformer's layers and match."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from handformer import FullAttention, LocalAttention
from handformer.attention.kinds import AttentionKind
from handformer.pretrained import BertConfig, BertModel, BertTokenizer, embed, load_bert
from pretrained_util import tiny_checkpoint

ATOL = 1e-5


def batch(vocab: int = 64, lengths: tuple[int, ...] = (9, 5, 2)) -> dict[str, torch.Tensor]:
    """A padded batch of random ids, real tokens first, with two segments."""
    L = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), L))
    mask = (torch.arange(L) < torch.tensor(lengths).unsqueeze(1)).long()  # (B, L)
    types = ((torch.arange(L) >= torch.tensor(lengths).unsqueeze(1) // 2).long() * mask)
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}


def compare(model: BertModel, ref: transformers.BertModel, enc: dict[str, torch.Tensor]
            ) -> None:
    with torch.no_grad():
        got = model(**enc, need_weights=True)
        want = ref(**enc, output_attentions=True)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=ATOL, rtol=0)
    if ref.pooler is None:
        assert got.pooler_output is None
    else:
        torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=ATOL, rtol=0)
    assert len(got.attentions) == len(want.attentions)
    for g, w in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    with torch.no_grad():  # the fused path (no weights) gives the same hidden states
        fast = model(**enc)
    assert fast.attentions is None
    torch.testing.assert_close(fast.last_hidden_state, want.last_hidden_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("sizes", [
    dict(hidden_size=32, layers=2, heads=4, intermediate=37),
    dict(hidden_size=48, layers=3, heads=3, intermediate=64, hidden_act="relu"),
    dict(hidden_size=16, layers=1, heads=1, intermediate=8, pooler=False),
    dict(hidden_size=64, layers=2, heads=8, intermediate=100, hidden_act="gelu_new",
         pooler=False, eps=1e-3),
])
def test_random_configs_match_transformers(tmp_path, sizes) -> None:
    ref = tiny_checkpoint(tmp_path, **sizes)
    model, tokenizer = load_bert(tmp_path)
    assert (model.pooler is None) == (ref.pooler is None)
    assert model.config.layer_norm_eps == sizes.get("eps", 1e-7)
    assert len(model.blocks) == sizes["layers"]
    compare(model, ref, batch())
    compare(model, ref, batch(lengths=(7,)))


def test_prefixed_masked_lm_checkpoint(tmp_path) -> None:
    ref = tiny_checkpoint(tmp_path, masked_lm=True)
    model, _ = load_bert(tmp_path)
    assert model.pooler is None  # BertForMaskedLM has none
    compare(model, ref, batch())


def test_renamed_prefixed_keys_with_old_layernorm_names(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    ref = tiny_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    renamed = {}
    for k, v in state.items():
        k = k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                     "LayerNorm.beta")
        renamed["bert." + k] = v
    renamed["classifier.weight"] = torch.zeros(2, 32)  # a task head: skipped
    save_file(renamed, tmp_path / "model.safetensors")
    model, _ = load_bert(tmp_path / "model.safetensors")
    compare(model, ref, batch())


def test_vocab_txt_tokenizer_matches_transformers(tmp_path) -> None:
    tiny_checkpoint(tmp_path)
    _, tokenizer = load_bert(tmp_path)
    assert tokenizer.max_length == 64
    reference = transformers.BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=True)
    texts = ["The cat sat on the mat", "Blue birds SING loudly", "a dóg ran, fast!"]
    pairs = ["red house", "the tree", "big"]
    got = tokenizer(texts, pairs)
    want = reference(texts, pairs, padding=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(got[key], want[key]), key
    assert tokenizer.tokens("the cats") == ["[CLS]", "the", "cat", "##s", "[SEP]"]
    same = tokenizer(list(zip(texts, pairs, strict=True)))
    assert torch.equal(same["input_ids"], got["input_ids"])


def test_tokenizer_json_limits_follow_config(tmp_path) -> None:
    tiny_checkpoint(tmp_path, max_positions=16)
    _, tokenizer = load_bert(tmp_path)
    assert tokenizer.max_length == 16
    with pytest.warns(UserWarning, match="truncated to 16"):
        enc = tokenizer(["the " * 40, "cat"])
    assert enc["input_ids"].shape == (2, 16)
    with pytest.warns(UserWarning, match="truncated to 8"):
        pair = tokenizer("the " * 10, "dog " * 10, max_length=8)
    assert pair["input_ids"].shape == (1, 8) and pair["token_type_ids"].sum() > 0


def test_attention_kind_swaps_in_every_layer(tmp_path) -> None:
    calls = []

    class Counting(AttentionKind):
        supports_dropout = True

        def forward(self, q, k, v, **kwargs):
            calls.append(q.shape)
            return FullAttention()(q, k, v, **kwargs)

    ref = tiny_checkpoint(tmp_path, layers=3)
    model, _ = load_bert(tmp_path, attention=Counting())
    kinds = [layer.attn.attention for layer in model.blocks]
    assert all(isinstance(k, Counting) for k in kinds) and len({id(k) for k in kinds}) == 3
    compare(model, ref, batch())
    assert len(calls) == 6  # 3 layers, weights pass + fused pass
    factory_model, _ = load_bert(tmp_path, attention=Counting)
    assert isinstance(factory_model.blocks[2].attn.attention, Counting)
    with pytest.raises(TypeError, match="attention must be"):
        load_bert(tmp_path, attention=42)
    named, _ = load_bert(tmp_path, attention="local", window_size=3)  # names, as the CLI's
    assert isinstance(named.blocks[0].attn.attention, LocalAttention)


def test_float64_load_and_embed_default_pooling(tmp_path) -> None:
    ref = tiny_checkpoint(tmp_path).double()
    model, tokenizer = load_bert(tmp_path, dtype=torch.float64)
    assert model.embeddings.word_embeddings.weight.dtype == torch.float64
    compare(model, ref, batch())
    assert model.sentence_pooling is None  # no sentence-transformers files: mean, unnormalised
    texts = ["the cat sat", "a dog ran fast on the mat"]
    enc = tokenizer(texts)
    with torch.no_grad():
        hidden = ref(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).double()
    want = (hidden * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(embed(texts, model=model, tokenizer=tokenizer), want)


def test_sentence_transformers_pooling_modes(tmp_path) -> None:
    ref = tiny_checkpoint(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 6}))
    model, tokenizer = load_bert(tmp_path)
    texts = ["the cat sat on the mat the dog ran", "a bird"]
    with pytest.warns(UserWarning, match="truncated to 6"):
        got = embed(texts, model=model, tokenizer=tokenizer)
        enc = tokenizer(texts, max_length=6)
    with torch.no_grad():
        hidden = ref(**enc).last_hidden_state  # (B, L, E)
    blocked = hidden.masked_fill(enc["attention_mask"].unsqueeze(-1) == 0, float("-inf"))
    want = torch.cat([hidden[:, 0], blocked.amax(1)], dim=-1)  # cls, then max
    torch.testing.assert_close(got, torch.nn.functional.normalize(want, dim=-1), atol=ATOL,
                               rtol=0)


def test_config_from_dict_reads_hf_keys() -> None:
    c = BertConfig.from_dict({"model_type": "bert", "hidden_size": 24, "num_attention_heads": 2,
                              "num_hidden_layers": 1, "intermediate_size": 8,
                              "layer_norm_eps": 1e-6, "architectures": ["BertModel"]})
    assert (c.hidden_size, c.num_attention_heads, c.layer_norm_eps) == (24, 2, 1e-6)
    assert BertConfig.from_dict(c.to_dict()) == c
    model = BertModel(c, add_pooling_layer=False)
    assert model.blocks[0].ln1.eps == 1e-6
    assert BertTokenizer.__module__.startswith("handformer.tokenizers.")  # our own, exported


def test_local_attention_kind_on_a_checkpoint(tmp_path) -> None:
    from handformer import LocalAttention
    from handformer.masks import window_mask

    ref = tiny_checkpoint(tmp_path)
    enc = batch(lengths=(9, 9))
    wide, _ = load_bert(tmp_path, attention=LocalAttention(2 * 9 + 1))
    compare(wide, ref, enc)  # a window covering everything is full attention
    narrow, _ = load_bert(tmp_path, attention=LocalAttention(3))
    with torch.no_grad():
        out = narrow(**enc, need_weights=True)
        full = ref(**enc).last_hidden_state
    outside = ~window_mask(9, 9, 3)  # (L, L)
    for weights in out.attentions:
        assert weights[..., outside].abs().max() == 0
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert (out.last_hidden_state - full).abs().max() > 1e-3
