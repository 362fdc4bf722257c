"""Every GGUF metadata value that reaches the model's config is checked where it is read: a
bad one is a one-line ``CheckpointError`` that names the file and the key (never a config
error without either), and the documented leniency holds: a special token id outside the
vocabulary is left out, as llama.cpp does, with a one-line warning from the tokenizer.

Each case writes a tiny GGUF file (a random transformers model through
``gguf_util.hf_to_gguf``) with one bad value."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGUFValueType as T

from gguf_util import gpt2_to_gguf, hf_to_gguf
from handformer.pretrained import CheckpointError, load_lm
from tokenizer_util import as_metadata, spm_fields

U32, U64, I32, F32, STR, ARR = T.UINT32, T.UINT64, T.INT32, T.FLOAT32, T.STRING, T.ARRAY
BASE = dict(vocab_size=297, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=64)


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[dict, dict]]:
    torch.manual_seed(0)
    out = {}
    for arch, cls, config in (
            ("llama", transformers.LlamaForCausalLM, transformers.LlamaConfig(**BASE)),
            ("gemma3", transformers.Gemma3ForCausalLM,
             transformers.Gemma3TextConfig(**BASE, sliding_window=4)),
            ("gemma2", transformers.Gemma2ForCausalLM,
             transformers.Gemma2Config(**BASE, sliding_window=4)),
            ("gpt2", transformers.GPT2LMHeadModel,
             transformers.GPT2Config(vocab_size=297, n_positions=64, n_embd=16, n_layer=1,
                                     n_head=2))):
        model = cls(config).eval()
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        out[arch] = (state, config.to_dict())
    return out


def _tokenizer() -> dict[str, tuple]:
    """A valid SentencePiece tokenizer (297 tokens) as typed GGUF metadata."""
    meta = as_metadata("llama", "llama", spm_fields())
    del meta["general.architecture"]
    types = {"tokenizer.ggml.model": STR, "tokenizer.ggml.bos_token_id": U32,
             "tokenizer.ggml.eos_token_id": U32, "tokenizer.ggml.unknown_token_id": U32}
    return {k: (types.get(k, ARR), v) for k, v in meta.items()}


def _write(tmp_path: Path, models: dict, arch: str, changes: dict[str, tuple]) -> Path:
    state, config = models[arch]
    write = gpt2_to_gguf if arch == "gpt2" else (
        lambda *a, **k: hf_to_gguf(*a[:2], arch, *a[2:], **k))
    return write(state, config, tmp_path / f"{arch}.gguf", metadata={**_tokenizer(), **changes})


# (architecture, metadata changes, the key the refusal names, an excerpt of the message)
REFUSED = [
    ("llama", {"llama.context_length": (U64, 2**31)}, "llama.context_length",
     "must be in [1, 2147483647], got 2147483648"),
    ("llama", {"llama.context_length": (U32, 0)}, "llama.context_length", "got 0"),
    ("llama", {"llama.context_length": (STR, "64")}, "llama.context_length",
     "must be an integer, got string"),
    ("llama", {"llama.embedding_length": (U32, 0)}, "llama.embedding_length", "got 0"),
    ("llama", {"llama.block_count": (U32, 0)}, "llama.block_count", "got 0"),
    ("llama", {"llama.feed_forward_length": (U32, 0)}, "llama.feed_forward_length", "got 0"),
    ("llama", {"llama.attention.head_count": (U32, 0)}, "llama.attention.head_count",
     "got 0"),
    ("llama", {"llama.attention.head_count_kv": (U32, 3)}, "llama.attention.head_count_kv",
     "got 3"),
    ("llama", {"llama.attention.key_length": (U32, 7), "llama.attention.value_length":
               (U32, 7)}, "llama.attention.key_length", "must be even"),
    ("llama", {"llama.attention.value_length": (U32, 4)}, "llama.attention.value_length",
     "differs from the key length"),
    ("llama", {"llama.rope.freq_base": (F32, 1.0)}, "llama.rope.freq_base",
     "must be a number > 1 (the RoPE base), got 1.0"),
    ("llama", {"llama.rope.freq_base": (F32, 0.5)}, "llama.rope.freq_base", "got 0.5"),
    ("llama", {"llama.rope.freq_base": (F32, float("nan"))}, "llama.rope.freq_base",
     "must be a finite positive number"),
    ("llama", {"llama.attention.layer_norm_rms_epsilon": (F32, 0.0)},
     "llama.attention.layer_norm_rms_epsilon", "must be a finite positive number"),
    ("llama", {"llama.rope.scaling.type": (STR, "yarn")}, "llama.rope.scaling.type",
     "'yarn' is not supported"),
    ("llama", {"llama.rope.scaling.type": (STR, "linear"),
               "llama.rope.scaling.factor": (F32, -2.0)}, "llama.rope.scaling.factor",
     "must be a finite positive number"),
    ("llama", {"tokenizer.ggml.eos_token_id": (STR, "2")}, "tokenizer.ggml.eos_token_id",
     "must be an integer"),
    ("gemma3", {"gemma3.attention.sliding_window": (U32, 0)},
     "gemma3.attention.sliding_window", "got 0"),
    ("gemma3", {"gemma3.attention.sliding_window": (U64, 2**31)},
     "gemma3.attention.sliding_window", "must be in [1, 2147483647]"),
    ("gemma3", {"gemma3.rope.freq_base": (F32, 1.0)}, "gemma3.rope.freq_base",
     "must be a number > 1"),
    ("gemma3", {"gemma3.attention.sliding_window_pattern": (ARR, [True])},
     "gemma3.attention.sliding_window_pattern", "must be an array of 2 bools"),
    ("gemma2", {"gemma2.attn_logit_softcapping": (F32, 0.0)}, "gemma2.attn_logit_softcapping",
     "must be a finite positive number"),
    ("gemma2", {"gemma2.final_logit_softcapping": (F32, float("inf"))},
     "gemma2.final_logit_softcapping", "must be a finite positive number"),
    ("gemma2", {"gemma2.rope.freq_base": (F32, 0.9)}, "gemma2.rope.freq_base",
     "must be a number > 1"),
    ("gpt2", {"gpt2.context_length": (U64, 2**31)}, "gpt2.context_length",
     "must be in [1, 2147483647]"),
    ("gpt2", {"gpt2.attention.layer_norm_epsilon": (F32, -1.0)},
     "gpt2.attention.layer_norm_epsilon", "must be a finite positive number"),
    ("gpt2", {"gpt2.attention.head_count": (U32, 0)}, "gpt2.attention.head_count", "got 0"),
]


@pytest.mark.parametrize("arch, changes, key, excerpt", REFUSED,
                         ids=[f"{c[2]}={next(iter(c[1].values()))[1]}" for c in REFUSED])
def test_a_bad_metadata_value_names_the_file_and_key(
        arch: str, changes: dict, key: str, excerpt: str, tmp_path: Path, models: dict) -> None:
    path = _write(tmp_path, models, arch, changes)
    with pytest.raises(CheckpointError) as exc:
        load_lm(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: {key}"), message
    assert excerpt in message and "\n" not in message


def test_the_good_file_loads(tmp_path: Path, models: dict) -> None:
    for arch in models:
        model, tokenizer = load_lm(_write(tmp_path, models, arch, {}))
        assert model.config.max_len == 64 and tokenizer.eos_token_id == 2, arch


@pytest.mark.parametrize("key, value", [
    ("tokenizer.ggml.eos_token_id", (U32, 10**9)),
    ("tokenizer.ggml.bos_token_id", (U64, 2**40)),
    ("tokenizer.ggml.padding_token_id", (U32, 297)),
    ("tokenizer.ggml.bos_token_id", (I32, -7)),
])
def test_a_special_id_outside_the_vocabulary_is_left_out(
        key: str, value: tuple, tmp_path: Path, models: dict) -> None:
    path = _write(tmp_path, models, "llama", {key: value})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = load_lm(path)
    notes = [str(w.message) for w in caught if key in str(w.message)]
    assert notes == [f"{path}: {key} is {value[1]}, outside the vocabulary of 297 tokens; "
                     "left out"]
    name = key.removeprefix("tokenizer.ggml.").replace("padding", "pad")
    assert getattr(tokenizer, name) is None
    if name == "bos_token_id":  # SentencePiece adds BOS by default: not a missing one
        assert tokenizer.encode("a") and tokenizer.encode("a")[0] != value[1]
    ids = tokenizer.encode("hello")
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), 297)  # it runs
