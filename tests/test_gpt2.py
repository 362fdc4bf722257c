"""load_gpt2 on tiny random GPT-2 checkpoints written by transformers (no downloads)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import handformer as hf
from handformer.pretrained import CheckpointError, TextTokenizer, load_gpt2

transformers = pytest.importorskip("transformers")
V, EOS = 97, 96


def save_gpt2(folder: Path, *, seed: int = 0, **options: object) -> transformers.GPT2LMHeadModel:
    """A random GPT2LMHeadModel saved by transformers into ``folder`` (safetensors)."""
    settings = dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                    bos_token_id=EOS, eos_token_id=EOS, initializer_range=0.2)
    settings.update(options)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).eval()
        model.save_pretrained(folder, safe_serialization=True)
    return model


SIZES = {
    "tied-2x32": dict(),
    "tied-3x48-inner": dict(n_embd=48, n_layer=3, n_head=3, n_inner=80),
    "untied-1x16": dict(n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=False),
    "untied-gelu-4x24": dict(n_embd=24, n_layer=4, n_head=6, tie_word_embeddings=False,
                             activation_function="gelu", layer_norm_epsilon=1e-3),
}


@pytest.mark.parametrize("size", list(SIZES))
def test_logits_and_greedy_generation_match_transformers(tmp_path: Path, size: str) -> None:
    reference = save_gpt2(tmp_path, **SIZES[size])
    with pytest.warns(UserWarning, match="has no tokenizer: expected tokenizer.json, or "
                                         "vocab.json \\+ merges.txt"):
        model, tokenizer = load_gpt2(tmp_path)
    assert tokenizer is None and not model.training
    assert (model.lm_head.weight is model.tok_emb.weight) == model.config.tie_weights
    ids = torch.randint(0, V - 1, (2, 13))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)

    prompt = ids[:, :5]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=32, do_sample=False, eos_token_id=EOS,
                                    pad_token_id=EOS)
    ours = model.generate(prompt, max_new_tokens=32, eos_token_id=EOS)
    assert ours.tolist() == theirs.tolist()
    if size == "tied-2x32":  # (the cache is tested for every kind in test_generate.py)
        uncached = model.generate(prompt, max_new_tokens=32, eos_token_id=EOS,
                                  use_cache=False)
        assert uncached.tolist() == ours.tolist()
    assert ours.shape[1] > 5 + 8  # it did generate


def test_left_padded_logits_match_transformers_with_position_ids(tmp_path: Path) -> None:
    reference = save_gpt2(tmp_path)
    model, _ = load_gpt2(tmp_path, tokenizer=False)
    ids = torch.randint(0, V - 1, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_unprefixed_gpt2model_keys_and_dtype(tmp_path: Path) -> None:
    reference = save_gpt2(tmp_path / "lm")
    base = tmp_path / "base"
    reference.transformer.save_pretrained(base, safe_serialization=True)  # GPT2Model keys
    model, _ = load_gpt2(base / "model.safetensors", dtype=torch.float64, tokenizer=False)
    assert model.tok_emb.weight.dtype == torch.float64
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        expected = reference(ids).logits.double()
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_tokenizer_json_is_loaded(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_gpt2(tmp_path)
    vocab = {f"w{i}": i for i in range(V - 1)} | {"<|endoftext|>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    _, tokenizer = load_gpt2(tmp_path)
    assert isinstance(tokenizer, TextTokenizer)
    assert tokenizer.encode("w3 w5 w90") == [3, 5, 90]
    assert tokenizer.decode([3, 5]) == "w3 w5"
    assert tokenizer.eos_token_id == EOS and len(tokenizer) == V
    with pytest.raises(TypeError, match="text must be a string"):
        tokenizer.encode(3)


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_failed_loads(tmp_path: Path) -> None:
    tied, untied = tmp_path / "tied", tmp_path / "untied"
    save_gpt2(tied)
    save_gpt2(untied, tie_word_embeddings=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        load_gpt2(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_gpt2(tied, dtype=torch.int64)

    edit_config(tied, n_layer=3)
    with pytest.raises(CheckpointError, match=r"(?s)nothing was loaded.*missing keys.*"
                                              r"transformer\.h\.2\.attn\.c_attn\.weight"):
        load_gpt2(tied)
    edit_config(tied, n_layer=2, n_embd=64)
    with pytest.raises(CheckpointError, match=r"transformer\.wte\.weight: model "
                                              r"transformer\.wte\.weight expects \(97, 64\), "
                                              r"found \(97, 32\)"):
        load_gpt2(tied)
    edit_config(tied, n_embd=32, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"missing keys.*\n  lm_head\.weight"):
        load_gpt2(tied)
    edit_config(untied, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="duplicated keys"):
        load_gpt2(untied)
    edit_config(untied, model_type="bert")
    with pytest.raises(ValueError, match="load_gpt2 reads 'gpt2' checkpoints"):
        load_gpt2(untied)
    edit_config(untied, model_type="gpt2", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="not supported by handformer.*inverse_layer_idx"):
        load_gpt2(untied)

    weights = untied / "model.safetensors"
    edit_config(untied, scale_attn_by_inverse_layer_idx=False, tie_word_embeddings=False)
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_gpt2(untied)
    weights.unlink()
    (untied / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin but no "
                                              "model.safetensors.*refused on purpose"):
        load_gpt2(untied)
    (untied / "config.json").unlink()
    with pytest.raises(CheckpointError, match="pytorch_model.bin is a pickle checkpoint"):
        load_gpt2(untied / "pytorch_model.bin")


def test_loaded_model_saves_as_a_causal_lm(tmp_path: Path) -> None:
    save_gpt2(tmp_path / "gpt2")
    model, _ = load_gpt2(tmp_path / "gpt2", tokenizer=False)
    model.save_pretrained(tmp_path / "ours")
    again = hf.CausalLM.from_pretrained(tmp_path / "ours")
    ids = torch.randint(0, V, (1, 7))
    torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
