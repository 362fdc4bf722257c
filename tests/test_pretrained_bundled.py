"""The bundled all-MiniLM-L6-v2 on handformer's layers vs transformers' BertModel (eager)."""

from __future__ import annotations

import pytest
import torch
import transformers

from handformer.pretrained import BertModel, BertTokenizer, bundled_model_dir, embed, load_bert

ATOL = 1e-5


@pytest.fixture(scope="module")
def ours() -> tuple[BertModel, BertTokenizer]:
    return load_bert()


@pytest.fixture(scope="module")
def ref() -> transformers.BertModel:
    return transformers.BertModel.from_pretrained(
        str(bundled_model_dir()), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_tokenizer() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(bundled_model_dir()))


def compare(ours, ref, enc: dict[str, torch.Tensor]) -> None:
    model, _ = ours
    with torch.no_grad():
        got = model(**enc, need_weights=True)
        want = ref(**enc, output_attentions=True)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=ATOL, rtol=0)
    assert len(got.attentions) == len(want.attentions) == 6
    B, L = enc["input_ids"].shape
    for g, w in zip(got.attentions, want.attentions, strict=True):
        assert g.shape == w.shape == (B, 12, L, L)
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_config_and_structure(ours) -> None:
    model, tokenizer = ours
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    assert model.config.layer_norm_eps == 1e-12
    assert model.max_positions == 512 == tokenizer.max_length
    assert model.blocks[0].attn.num_heads == 12
    assert model.blocks[0].mlp.activation_name == "gelu"
    assert not model.training
    assert model.sentence_pooling.modes == ("mean",) and model.sentence_pooling.normalize


def test_tokenizer_matches_transformers(ours, hf_tokenizer) -> None:
    _, tokenizer = ours
    texts = ["Hello, world!", "Transformers can't attend to the FUTURE... naïvely?",
             "一个简单的 Transformer"]
    got = tokenizer(texts)
    want = hf_tokenizer(texts, padding=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(got[key], want[key]), key
    assert tokenizer.tokens("Hello, world!") == ["[CLS]", "hello", ",", "world", "!", "[SEP]"]


def test_single_sentence(ours, ref) -> None:
    compare(ours, ref, ours[1]("The animal didn't cross the street because it was too tired."))


def test_padded_batch(ours, ref) -> None:
    enc = ours[1](["Short.", "A somewhat longer sentence about cats.",
                   "The longest sentence of this batch, with many more words than the others."])
    assert enc["attention_mask"].sum(1).unique().numel() == 3  # three different lengths
    compare(ours, ref, enc)


def test_sentence_pairs(ours, ref) -> None:
    enc = ours[1]([("Where is the cat?", "The cat sat on the mat."),
                   ("Is it raining?", "No.")])
    assert enc["token_type_ids"].sum() > 0
    compare(ours, ref, enc)


def test_512_token_input(ours, ref) -> None:
    text = " ".join(["attention"] + ["word"] * 600)
    with pytest.warns(UserWarning, match="truncated to 512"):
        enc = ours[1](text)
    assert enc["input_ids"].shape == (1, 512)
    compare(ours, ref, enc)


def test_embed_matches_mean_pooled_reference(ours, ref, hf_tokenizer) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread.",
             "The girl is carrying a baby.", "A man is riding a horse.",
             "A woman is playing violin.", "Two men pushed carts through the woods."]
    got = embed(texts, batch_size=4)
    enc = hf_tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = ref(**enc).last_hidden_state.double()
    mask = enc["attention_mask"].unsqueeze(-1).double()
    want = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert got.shape == (6, 384) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    assert not got.is_inference()


def test_embed_ranks_paraphrases_first() -> None:
    queries = ["How do I bake bread at home?", "The stock market fell sharply today.",
               "My cat sleeps all day."]
    paraphrases = ["What is a simple recipe for homemade bread?",
                   "Share prices dropped a lot this afternoon.",
                   "The kitten naps from morning to night."]
    q, p = embed(queries), embed(paraphrases)
    sims = q @ p.T  # (3, 3)
    assert torch.equal(sims.argmax(dim=1), torch.arange(3))
    assert torch.equal(sims.argmax(dim=0), torch.arange(3))


def test_embed_order_and_batching_do_not_matter() -> None:
    texts = ["one", "a much longer text with quite a few words in it", "two words", "three"]
    a = embed(texts, batch_size=1)
    b = embed(texts, batch_size=3)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(embed(texts[::-1]), a.flip(0), atol=ATOL, rtol=0)
    torch.testing.assert_close(embed("one"), a[:1], atol=ATOL, rtol=0)
