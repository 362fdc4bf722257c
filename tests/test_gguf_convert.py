"""gguf_to_hf: GGUF back to a Hugging Face checkpoint, llama.cpp's fix-ups undone.

Tiny checkpoints written by transformers are converted to GGUF the way llama.cpp's converter
does it (tests/gguf_util.py: its names and metadata keys, the Q/K permutation for ``llama``,
``w + 1`` Gemma norms, transposed GPT-2 weights) and must come back exactly, with a config
that rebuilds a transformers model giving the same logits. Each fix-up is shown to matter.
On the two shipped files, every tensor equals what transformers' own GGUF loader produces.
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFValueType
from safetensors.torch import load_file

from conftest import hf_gguf_reference
from gguf_util import (
    BOOL,
    STR,
    U32,
    gpt2_to_gguf,
    hf_to_gguf,
    llamacpp_permute,
    tiny_llama_gguf,
    write_gguf,
)
from handformer.pretrained import CheckpointError
from handformer.pretrained.gguf import (
    SUPPORTED_ARCHITECTURES,
    GGUFState,
    gguf_state,
    gguf_to_hf,
    read_gguf,
)
from handformer.pretrained.gguf.convert import llama_row_order
from handformer.weights import DTYPES

IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4, 6, 8, 10, 12, 13, 14]])


def save_hf(model: transformers.PreTrainedModel, folder: Path) -> tuple[dict, dict]:
    """save_pretrained, then read back (config.json dict, safetensors state)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    return model.config.to_dict(), load_file(folder / "model.safetensors")


def rebuild(config: dict, state: dict[str, torch.Tensor]) -> transformers.PreTrainedModel:
    """A transformers model from gguf_to_hf's config and state (strict but for a tied head)."""
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
        hf_config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if config["tie_word_embeddings"]
                                        else set())
    return model.eval()


def logits(model: transformers.PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def assert_same_state(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value.float()), key


def build(cls: type, config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).eval()


# ---- llama: Q/K rows permuted ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict, torch.Tensor]:
    """A tiny Llama with attention biases (so the bias permutation is exercised too), GQA
    (K permuted with the KV head count) and an untied head."""
    folder = tmp_path_factory.mktemp("llama")
    model = build(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():  # biases and norms random too
            p.copy_(torch.randn_like(p) * 0.5)
    config, state = save_hf(model, folder)
    path = hf_to_gguf(state, config, "llama", folder / "llama.gguf",
                      metadata={"llama.rope.freq_base": (GGUFValueType.FLOAT32, 5000.0)})
    return path, config, state, logits(model)


def test_llama_comes_back_exactly(tiny_llama: tuple) -> None:
    path, _, state, expected = tiny_llama
    config, ours = gguf_to_hf(path)
    assert_same_state(ours, state)
    assert config["model_type"] == "llama" and config["attention_bias"] is True
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 40
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    torch.testing.assert_close(logits(rebuild(config, ours)), expected, rtol=0, atol=1e-5)


def _assert_lazy_state_is_the_eager_one(path: Path, dtype: torch.dtype) -> None:
    """gguf_state: a header that describes each tensor before it is read, and the tensors
    gguf_to_hf returns, fresh on every access."""
    _, eager = gguf_to_hf(path, dtype=dtype)
    _, lazy = gguf_state(path, dtype=dtype)
    assert isinstance(lazy, GGUFState) and sorted(lazy) == sorted(eager)
    for name, tensor in eager.items():
        assert lazy.header[name]["shape"] == list(tensor.shape), name
        assert DTYPES[lazy.header[name]["dtype"]] == tensor.dtype == dtype
        first = lazy[name]
        torch.testing.assert_close(first, tensor, rtol=0, atol=0)
        assert lazy[name].data_ptr() != first.data_ptr()  # read again, not kept
        out = torch.full_like(tensor, float("nan"))
        assert lazy.read_into(name, out).data_ptr() == out.data_ptr()  # into out's memory
        torch.testing.assert_close(out, tensor, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_state_llama(tiny_llama: tuple, dtype: torch.dtype) -> None:
    _assert_lazy_state_is_the_eager_one(tiny_llama[0], dtype)  # Q/K rows permuted


def test_llama_permutation_matters(tiny_llama: tuple, tmp_path: Path) -> None:
    """Written without llama.cpp's permutation, Q and K (weights and biases) come back
    scrambled: gguf_to_hf does undo a permutation, with H for Q and H_kv for K."""
    _, config, state, _ = tiny_llama
    plain = hf_to_gguf(state, config, "qwen2", tmp_path / "x.gguf")  # no permutation...
    data = bytearray(plain.read_bytes())  # ...but read as a llama file
    data[:] = data.replace(b"qwen2", b"llama")
    (tmp_path / "x.gguf").write_bytes(bytes(data))
    _, ours = gguf_to_hf(tmp_path / "x.gguf")
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"):
        key = f"model.layers.0.self_attn.{name}"
        assert not torch.equal(ours[key], state[key]), name
        heads = 4 if name.startswith("q") else 2
        assert torch.equal(llamacpp_permute(ours[key], heads).float(), state[key])  # inverse
    assert torch.equal(ours["model.layers.0.self_attn.v_proj.weight"],
                       state["model.layers.0.self_attn.v_proj.weight"])


def test_llama_row_order_inverts_the_permutation() -> None:
    w = torch.arange(3 * 8 * 2.0).reshape(3 * 8, 2)  # 3 heads, head dim 8
    permuted = llamacpp_permute(w, 3)
    restored = torch.empty_like(w)
    restored[llama_row_order(3, 8)] = permuted
    assert torch.equal(restored, w)


# ---- qwen2 / qwen3: not permuted ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_is_not_permuted(arch: str, tmp_path: Path) -> None:
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    if arch == "qwen2":
        model = build(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common))
    else:
        model = build(transformers.Qwen3ForCausalLM,
                      transformers.Qwen3Config(**common, head_dim=16))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    config, state = save_hf(model, tmp_path)
    config, ours = gguf_to_hf(hf_to_gguf(state, config, arch, tmp_path / "q.gguf"))
    assert_same_state(ours, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert config["model_type"] == arch and config["tie_word_embeddings"] is True
    if arch == "qwen3":
        assert config["head_dim"] == 16 and "model.layers.1.self_attn.q_norm.weight" in ours
    else:
        assert "model.layers.1.self_attn.q_proj.bias" in ours
    torch.testing.assert_close(logits(rebuild(config, ours)), logits(model), rtol=0,
                               atol=1e-5)


# ---- gemma: norms stored as w + 1, what the file does not say ----------------------------------


def _exact_norms(model: torch.nn.Module) -> None:
    """Norm weights on a 1/64 grid, so (w + 1) - 1 == w exactly in float32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randint(-40, 40, p.shape) / 64)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict,
                                                                     transformers.PreTrainedModel]:
    """7 layers (sliding x5, global, sliding), window 4 < the 14-token input, QK-norm, MQA,
    local RoPE base 10,000 and global 1,000,000: logits depend on everything supplied."""
    folder = tmp_path_factory.mktemp("gemma3")
    model = build(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}))
    _exact_norms(model)
    config, state = save_hf(model, folder)
    meta = {"gemma3.rope.freq_base": (GGUFValueType.FLOAT32, 1e6),
            "gemma3.attention.sliding_window": (U32, 4)}
    path = hf_to_gguf(state, config, "gemma3", folder / "gemma3.gguf", metadata=meta)
    return path, config, state, model


def test_gemma3_comes_back_exactly(tiny_gemma3: tuple) -> None:
    path, _, state, model = tiny_gemma3
    config, ours = gguf_to_hf(path)
    assert_same_state(ours, state)
    assert "lm_head.weight" not in ours and config["tie_word_embeddings"] is True
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention",
                                                                 "sliding_attention"]
    assert config["query_pre_attn_scalar"] == 16 and config["sliding_window"] == 4
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    torch.testing.assert_close(logits(rebuild(config, ours)), logits(model), rtol=0, atol=1e-5)


@pytest.mark.parametrize("change", ["layer_types", "local_base", "query_scalar"])
def test_gemma3_supplied_fields_matter(tiny_gemma3: tuple, change: str) -> None:
    """Each value gguf_to_hf supplies changes the logits when it is wrong."""
    path, _, _, model = tiny_gemma3
    config, ours = gguf_to_hf(path)
    if change == "layer_types":
        config["layer_types"] = ["sliding_attention"] * 7
    elif change == "local_base":
        config["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e6
    else:
        config["query_pre_attn_scalar"] = 32
    assert not torch.allclose(logits(rebuild(config, ours)), logits(model), atol=1e-3)


def test_lazy_state_gemma3(tiny_gemma3: tuple) -> None:
    _assert_lazy_state_is_the_eager_one(tiny_gemma3[0], torch.float32)  # norms minus one


def test_gemma_norm_offset_matters(tiny_gemma3: tuple, tmp_path: Path) -> None:
    """Every *norm.weight (QK-norms included) gets 1 subtracted: a file written without the
    +1 comes back 1 lower."""
    _, config, state, _ = tiny_gemma3
    shifted = {k: (v - 1 if k.endswith("norm.weight") else v) for k, v in state.items()}
    meta = {"gemma3.attention.sliding_window": (U32, 4)}
    _, ours = gguf_to_hf(hf_to_gguf(shifted, config, "gemma3", tmp_path / "g.gguf",
                                    metadata=meta))
    norms = [k for k in state if k.endswith("norm.weight")]
    assert len(norms) == 7 * 6 + 1  # 4 layer norms + q/k norms per layer, and the final norm
    for key in norms:
        assert torch.equal(ours[key], state[key] - 1), key


def test_gemma2(tmp_path: Path) -> None:
    model = build(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, max_position_embeddings=64, attn_logit_softcapping=20.0,
        final_logit_softcapping=10.0))
    _exact_norms(model)
    config, state = save_hf(model, tmp_path)
    meta = {"gemma2.attention.sliding_window": (U32, 4),
            "gemma2.attn_logit_softcapping": (GGUFValueType.FLOAT32, 20.0),
            "gemma2.final_logit_softcapping": (GGUFValueType.FLOAT32, 10.0)}
    config, ours = gguf_to_hf(hf_to_gguf(state, config, "gemma2", tmp_path / "g.gguf",
                                         metadata=meta))
    assert_same_state(ours, state)
    assert config["layer_types"] == ["sliding_attention", "full_attention",
                                     "sliding_attention"]
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (20.0, 10.0)
    torch.testing.assert_close(logits(rebuild(config, ours)), logits(model), rtol=0, atol=1e-5)


# ---- gpt2: Conv1D weights transposed ------------------------------------------------------------


def test_gpt2(tmp_path: Path) -> None:
    model = build(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    config, state = save_hf(model, tmp_path)
    config, ours = gguf_to_hf(gpt2_to_gguf(state, config, tmp_path / "g.gguf"))
    # output.weight is a byte-for-byte copy of token_embd: tied, no lm_head.weight
    assert config["tie_word_embeddings"] is True
    assert_same_state(ours, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert ours["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    _assert_lazy_state_is_the_eager_one(tmp_path / "g.gguf", torch.float32)  # transposed
    torch.testing.assert_close(logits(rebuild(config, ours)), logits(model), rtol=0, atol=1e-5)


# ---- refusals ------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "mamba", {}, {"w": np.ones(4, np.float32)})
    with pytest.raises(CheckpointError) as info:
        gguf_to_hf(path)
    message = str(info.value)
    assert "general.architecture: 'mamba' is not supported" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def _retyped(tmp_path: Path, **changes: tuple) -> Path:
    """The tiny llama file rewritten with some metadata changed (None: removed)."""
    src = read_gguf(tiny_llama_gguf(tmp_path / "src.gguf"))
    meta = {}
    for key, value in src.metadata.items():
        if key != "general.architecture":  # GGUFWriter writes it
            meta[key] = (src.value_types[key][0], value)
    for key, change in changes.items():
        key = key.replace("__", ".")
        if change is None:
            meta.pop(key)
        else:
            meta[key] = change
    tensors = {}
    for name, info in src.tensors.items():
        rows = info.numel // info.shape[-1]
        raw = np.memmap(src.path, dtype=np.uint8, mode="r", offset=info.offset,
                        shape=(rows, info.nbytes // rows))
        if info.ggml_type == GGMLQuantizationType.F32:
            tensors[name] = np.array(raw).view(np.float32).reshape(info.shape)
        else:
            tensors[name] = (np.array(raw), info.ggml_type)
    return write_gguf(tmp_path / "changed.gguf", "llama", meta, tensors)


@pytest.mark.parametrize("changes,message", [
    ({"llama__block_count": None}, "llama.block_count: missing"),
    ({"llama__block_count": (STR, "one")}, "llama.block_count: must be an integer, got string"),
    ({"llama__block_count": (U32, 0)}, "llama.block_count: must be in [1, 11], got 0"),
    ({"llama__block_count": (U32, 2)}, "9 missing: blk.1.attn_q.weight"),
    ({"llama__attention__head_count_kv": (U32, 3)}, "3 does not divide the head count 4"),
    ({"llama__embedding_length": (U32, 64)}, "token_embd.weight: shape (16, 32) does not match"),
    ({"llama__feed_forward_length": (U32, 32)}, "mis-shaped: blk.0.ffn_gate.weight (64, 32) "
                                                "(expected (32, 32))"),
    ({"llama__rope__freq_base": (STR, "x")}, "llama.rope.freq_base: must be a number"),
    ({"llama__rope__freq_base": (GGUFValueType.FLOAT32, -1.0)}, "finite positive number"),
    ({"llama__rope__scaling__type": (STR, "yarn")}, "'yarn' is not supported"),
    ({"tokenizer__ggml__bos_token_id": (STR, "<s>")}, "tokenizer.ggml.bos_token_id: must be "
                                                      "an integer, got string"),
    ({"general__alignment": None, "x": (BOOL, True)}, None),  # loads
])
def test_metadata_refusals(tmp_path: Path, changes: dict, message: str | None) -> None:
    path = _retyped(tmp_path, **changes)
    if message is None:
        gguf_to_hf(path)
        return
    with pytest.raises(CheckpointError) as info:
        gguf_to_hf(path)
    assert message in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_special_ids_outside_the_vocabulary_are_left_out(tmp_path: Path) -> None:
    config, _ = gguf_to_hf(_retyped(tmp_path, tokenizer__ggml__bos_token_id=(U32, 99)))
    assert "bos_token_id" not in config and config["eos_token_id"] == 2


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    src = tiny_llama_gguf(tmp_path / "src.gguf", qtype=GGMLQuantizationType.F32)
    f = read_gguf(src)
    meta = {k: (f.value_types[k][0], v) for k, v in f.metadata.items()
            if k != "general.architecture"}
    tensors = {}
    for name, info in f.tensors.items():
        raw = np.fromfile(src, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        tensors[name] = raw.view(np.float32).reshape(info.shape)
    tensors["blk.0.extra.weight"] = np.ones(4, np.float32)
    with pytest.raises(CheckpointError, match=r"1 unexpected: blk.0.extra.weight"):
        gguf_to_hf(write_gguf(tmp_path / "x.gguf", "llama", meta, tensors))
    tensors.pop("blk.0.extra.weight")
    tensors["rope_freqs.weight"] = np.ones(4, np.float32)
    with pytest.raises(CheckpointError, match=r"rope_freqs.weight: per-frequency RoPE"):
        gguf_to_hf(write_gguf(tmp_path / "y.gguf", "llama", meta, tensors))


def test_vocab_is_the_embedding_rows_and_dtype(tmp_path: Path) -> None:
    path = tiny_llama_gguf(tmp_path / "t.gguf")
    config, state = gguf_to_hf(path, dtype=torch.bfloat16)
    assert config["vocab_size"] == 16 and state["model.embed_tokens.weight"].shape == (16, 32)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    _, full = gguf_to_hf(path)
    assert all(torch.equal(full[k].to(torch.bfloat16), v) for k, v in state.items())
    with pytest.raises(TypeError, match="dtype must be a floating"):
        gguf_to_hf(path, dtype=torch.int8)


# ---- the shipped files against transformers' GGUF loader ----------------------------------------


def _compare_with_transformers(name: str) -> dict[str, object]:
    """Load the file both ways once; keep only the comparison (Gemma through transformers
    takes about a minute and GBs of memory: the reference model is shared with the logits
    tests of test_shipped_llms.py through conftest)."""
    from handformer.pretrained.gguf import shipped_path

    path = shipped_path(name)
    config, ours = gguf_to_hf(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf_gguf_reference(path)  # loaded once per session (conftest), shared
    theirs = model.state_dict()
    summary = {
        "only_ours": sorted(set(ours) - set(theirs)),
        "only_theirs": sorted(set(theirs) - set(ours)),
        "different": [k for k in ours if k in theirs and not torch.equal(ours[k], theirs[k])],
        "tied": "lm_head.weight" not in ours and torch.equal(
            theirs["lm_head.weight"], theirs["model.embed_tokens.weight"]),
        "config": config,
        "their_config": model.config.to_dict(),
        "count": len(ours),
    }
    del model, theirs, ours
    gc.collect()
    return summary


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def shipped_comparison(request: pytest.FixtureRequest) -> dict[str, object]:
    return _compare_with_transformers(request.param)


@pytest.mark.slow
def test_shipped_tensors_equal_transformers(shipped_comparison: dict) -> None:
    s = shipped_comparison
    assert s["only_ours"] == [] and s["only_theirs"] == ["lm_head.weight"]
    assert s["tied"] and s["count"] > 200
    assert s["different"] == []


@pytest.mark.slow
def test_shipped_config_equals_transformers(shipped_comparison: dict) -> None:
    ours, theirs = shipped_comparison["config"], shipped_comparison["their_config"]
    keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id"]
    if ours["model_type"] == "gemma3_text":
        keys += ["layer_types", "sliding_window", "query_pre_attn_scalar",
                 "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation"]
    for key in keys:
        assert ours[key] == theirs[key], key
