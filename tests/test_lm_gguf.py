"""load_lm on GGUF files and shipped names (issue 21, the loading side).

* a tiny Llama and a tiny Gemma 3 written to GGUF here (with llama.cpp's Q/K permutation and
  ``w + 1`` norms) load through ``load_lm`` equal to the same Hugging Face checkpoint loaded
  through ``load_lm``;
* a shipped name loads the same model as its file (the two shipped files against transformers
  reading them are in test_shipped_llms.py);
* the commands take the names: ``generate``, ``viz``; ``embed`` refuses them.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("handformer.pretrained.gguf")
gguf_util = pytest.importorskip("gguf_util")

from handformer.cli import main  # noqa: E402
from handformer.packing import packed_linear  # noqa: E402
from handformer.pretrained import load_lm  # noqa: E402
from handformer.pretrained.lm import is_causal_source  # noqa: E402

U32 = gguf_util.U32
IDS = torch.randint(0, 48, (2, 14), generator=torch.Generator().manual_seed(5))


def _save(model: torch.nn.Module, folder: Path) -> tuple[dict, dict]:
    import json

    from safetensors.torch import load_file

    model.save_pretrained(folder)
    return (json.loads((folder / "config.json").read_text()),
            load_file(folder / "model.safetensors"))


def _exact_norms(model: torch.nn.Module) -> None:
    """Norm weights on a 1/64 grid, so (w + 1) - 1 == w exactly in float32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.split(".")[-2].startswith("ln"):
                p.copy_(torch.randint(-40, 40, p.shape) / 64)


def _logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_tiny_llama_gguf_equals_its_folder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    hf, state = _save(model, tmp_path / "hf")
    path = gguf_util.hf_to_gguf(state, hf, "llama", tmp_path / "llama.gguf")
    from_gguf, _ = load_lm(path, tokenizer=False)
    from_folder, _ = load_lm(tmp_path / "hf", tokenizer=False)
    torch.testing.assert_close(_logits(from_gguf), _logits(from_folder), atol=1e-6, rtol=0)
    assert is_causal_source(path)
    for ours, theirs in zip(from_gguf.blocks, from_folder.blocks, strict=True):
        # dequantized straight into q/k/v and gate/up packed back to back, Q/K rows unpermuted
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            owner = "attn" if len(group) == 3 else "mlp"
            mods = [getattr(getattr(ours, owner), n) for n in group]
            packed = packed_linear(*mods)
            assert packed is not None, group
            expected = torch.cat([getattr(getattr(theirs, owner), n).weight for n in group])
            torch.testing.assert_close(packed[0], expected, atol=1e-7, rtol=0)


def test_tiny_gemma3_gguf_equals_its_folder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}))
    _exact_norms(model)
    hf, state = _save(model, tmp_path / "hf")
    meta = {"gemma3.rope.freq_base": (gguf_util.GGUFValueType.FLOAT32, 1e6),
            "gemma3.attention.sliding_window": (U32, 4)}
    path = gguf_util.hf_to_gguf(state, hf, "gemma3", tmp_path / "gemma3.gguf", metadata=meta)
    from_gguf, _ = load_lm(path, tokenizer=False)
    from_folder, _ = load_lm(tmp_path / "hf", tokenizer=False)
    assert from_gguf.config.layer_types == from_folder.config.layer_types
    torch.testing.assert_close(_logits(from_gguf), _logits(from_folder), atol=1e-6, rtol=0)


# ---- the shipped files --------------------------------------------------------------------

PROMPTS = {"en": "The animal didn't cross the street because it was too",
           "zh": "动物没有过马路，因为它太",
           "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return"}


def test_a_shipped_name_loads_the_same_model_as_its_file(smollm2) -> None:
    """The name resolves to the package's file (the comparison of both shipped files with
    transformers is in test_shipped_llms.py, on the session's models)."""
    model, tok = smollm2
    ids = torch.tensor([tok.encode(PROMPTS["en"], add_special_tokens=True)])
    by_name, _ = load_lm("smollm2-135m-instruct", tokenizer=False)
    assert torch.equal(_logits(model, ids), _logits(by_name, ids))


def _run(*argv: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_commands_take_a_shipped_name(tmp_path: Path) -> None:
    code, out, err = _run("generate", "--model", "smollm2-135m-instruct", "--prompt",
                          "The capital of France is", "--max-new-tokens", 4)
    assert code == 0, err
    assert out.startswith("The capital of France is") and "Paris" in out
    code, out, err = _run("viz", "The capital of France is Paris", "--model",
                          "smollm2-135m-instruct", "--out", tmp_path)
    assert code == 0, err
    assert "30 layers x 9 heads" in out and (tmp_path / "index.html").is_file()
    code, _, err = _run("embed", "x", "--model", "smollm2-135m-instruct")
    assert code == 2 and "is a causal language model" in err
