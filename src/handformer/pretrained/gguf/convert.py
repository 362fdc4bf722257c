"""GGUF -> Hugging Face: ``gguf_to_hf(file) -> (config dict, state dict in HF names)``.

llama.cpp's converter renames every tensor (``model.layers.0.self_attn.q_proj.weight`` ->
``blk.0.attn_q.weight``), moves the config into metadata keys (``llama.block_count``, ...) and
changes a few tensors on the way. This module undoes all of it, so a GGUF file loads through
the same family key maps as a Hugging Face folder. Which architectures a family reads and
which of the fix-ups below its files need is declared once, in the family module's ``GGUF``
rules (:mod:`handformer.pretrained.families`); which tensors a file holds follows from the
family's own reading of the config:

- **Q/K row permutation** (architecture ``llama`` only: SmolLM, Llama, Mistral files).
  llama.cpp rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` while Hugging Face's Llama
  rotates halves ``(x_i, x_{i + D/2})``; the converter therefore reorders the rows of
  ``q_proj`` and ``k_proj`` (weights and biases) within each head, ``k_proj`` with the
  key/value head count. Qwen and Gemma files use the halves convention and are not permuted.
- **Gemma norms** are stored as ``w + 1`` (Gemma multiplies by ``1 + w``; llama.cpp by the
  stored value): every ``*norm.weight`` of a ``gemma2``/``gemma3`` file gets 1 subtracted (in
  float32, before rounding to the requested dtype).
- **What the file does not say.** Gemma 3's local RoPE base (10,000), its pattern of five
  sliding-window layers to one global layer, and ``query_pre_attn_scalar`` (the head dim; for
  the 27B layouts, hidden size / heads, as llama.cpp does) are supplied here. The vocabulary
  size is ``token_embd``'s row count, never trimmed to the tokenizer's. A file without
  ``output.weight`` (or whose ``output.weight`` is byte-for-byte ``token_embd``) ties the head
  to the embedding.
- **GPT-2**'s fused ``attn_qkv``, ``attn_output``, ``ffn_up`` and ``ffn_down`` are stored as
  ``(out, in)`` matrices; Hugging Face's ``Conv1D`` keeps ``(in, out)``: they come back as
  transposed views (no copy).

Every tensor is checked against the config before any is dequantized: a missing, unexpected
or mis-shaped tensor is a one-line :class:`CheckpointError` in the file's names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType, GGUFValueType

from handformer.checks import MAX_INT
from handformer.pretrained.families import GGUF_FAMILIES, Family, gguf_family_for
from handformer.pretrained.gguf.dequant import GGUFRows, dequantize_chunks, dequantize_tensor
from handformer.pretrained.gguf.reader import GGUFFile, TensorInfo, read_gguf
from handformer.weights import DTYPE_NAMES

__all__ = ["gguf_to_hf", "hf_config", "SUPPORTED_ARCHITECTURES", "llama_row_order"]

SUPPORTED_ARCHITECTURES = tuple(sorted(GGUF_FAMILIES))  # each family module's GGUF rules
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_SLIDING_PATTERN = 6  # five sliding-window layers, then one global layer
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales queries by E / H there
_INTS = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
         GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
_FLOATS = _INTS | {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_MISSING = object()


# ---- metadata, type-checked ------------------------------------------------------------------


def _int(f: GGUFFile, key: str, default: object = _MISSING, *, low: int = 1,
         high: int = MAX_INT) -> int:
    """An integer metadata value in ``[low, high]``; the error names the key and the value."""
    if key not in f.metadata:
        if default is _MISSING:
            raise f.error(key, "missing (needed for the model's config)")
        return default  # type: ignore[return-value]
    if len(f.value_types[key]) != 1 or f.value_types[key][0] not in _INTS:
        raise f.error(key, f"must be an integer, got {_type_name(f, key)}")
    value = f.metadata[key]
    if not low <= value <= high:
        raise f.error(key, f"must be in [{low}, {high}], got {value}")
    return value  # type: ignore[return-value]


def _float(f: GGUFFile, key: str, default: object = _MISSING, *, positive: bool = True) -> float:
    if key not in f.metadata:
        if default is _MISSING:
            raise f.error(key, "missing (needed for the model's config)")
        return default  # type: ignore[return-value]
    if len(f.value_types[key]) != 1 or f.value_types[key][0] not in _FLOATS:
        raise f.error(key, f"must be a number, got {_type_name(f, key)}")
    value = float(f.metadata[key])  # type: ignore[arg-type]
    if not np.isfinite(value) or (positive and value <= 0):
        raise f.error(key, f"must be a finite{' positive' if positive else ''} number, got "
                           f"{value}")
    return value


def _str(f: GGUFFile, key: str, default: str | None = None) -> str | None:
    if key not in f.metadata:
        return default
    if f.value_types[key] != (GGUFValueType.STRING,):
        raise f.error(key, f"must be a string, got {_type_name(f, key)}")
    return f.metadata[key]  # type: ignore[return-value]


def _type_name(f: GGUFFile, key: str) -> str:
    return " of ".join(t.name.lower() for t in f.value_types[key])


# ---- the config -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dims:
    """The sizes every decoder family shares, read from the metadata and ``token_embd``."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    context: int


def _dims(f: GGUFFile, arch: str) -> _Dims:
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise f.error("token_embd.weight", "missing: a language model needs its embedding")
    if len(emb.shape) != 2:
        raise f.error("token_embd.weight", f"must be a matrix (vocab, hidden), got shape "
                                           f"{emb.shape}")
    hidden = _int(f, f"{arch}.embedding_length")
    layers = _int(f, f"{arch}.block_count", high=len(f.tensors))
    heads = _int(f, f"{arch}.attention.head_count", high=hidden)
    kv_heads = _int(f, f"{arch}.attention.head_count_kv", heads, high=heads)
    if heads % kv_heads:
        raise f.error(f"{arch}.attention.head_count_kv", f"{kv_heads} does not divide the "
                                                         f"head count {heads}")
    head_dim = hidden // heads
    if f"{arch}.attention.key_length" in f.metadata:
        head_dim = _int(f, f"{arch}.attention.key_length", high=1 << 20)
    elif arch == "llama" and f"{arch}.rope.dimension_count" in f.metadata:
        head_dim = _int(f, f"{arch}.rope.dimension_count", high=1 << 20)
    if arch != "gpt2" and head_dim % 2:  # every other family rotates pairs of dims (RoPE)
        key = (f"{arch}.attention.key_length" if f"{arch}.attention.key_length" in f.metadata
               else f"{arch}.attention.head_count")
        raise f.error(key, f"head dim {head_dim} must be even for RoPE")
    value_dim = _int(f, f"{arch}.attention.value_length", head_dim, high=1 << 20)
    if value_dim != head_dim:
        raise f.error(f"{arch}.attention.value_length", f"{value_dim} differs from the key "
                                                        f"length {head_dim}; not supported")
    if emb.shape[1] != hidden:
        raise f.error("token_embd.weight", f"shape {emb.shape} does not match "
                                           f"{arch}.embedding_length={hidden}")
    ff = _int(f, f"{arch}.feed_forward_length", high=1 << 24)
    context = _int(f, f"{arch}.context_length", 2048)  # at most MAX_INT, as CausalLMConfig
    return _Dims(emb.shape[0], hidden, layers, heads, kv_heads, head_dim, ff, context)


def _rope(f: GGUFFile, arch: str, theta: float) -> tuple[dict, dict | None]:
    """``(rope_parameters, rope_scaling)`` from ``{arch}.rope.freq_base`` and scaling keys."""
    kind = _str(f, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}, None
    if kind != "linear":
        raise f.error(f"{arch}.rope.scaling.type", f"{kind!r} is not supported (none, linear)")
    factor = _float(f, f"{arch}.rope.scaling.factor")
    return ({"rope_type": "linear", "factor": factor, "rope_theta": theta},
            {"rope_type": "linear", "factor": factor})


def _token_ids(f: GGUFFile, vocab: int) -> dict[str, int]:
    """BOS/EOS/padding ids; one outside the vocabulary (negative ones, llama.cpp's -1 for
    "none", included) is left out (llama.cpp ignores it too, with a warning: the tokenizer
    gives that one), one of the wrong type is refused."""
    ids = {}
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        key = f"tokenizer.ggml.{theirs}"
        if key in f.metadata:
            value = _int(f, key, low=-(1 << 63), high=(1 << 64) - 1)
            if 0 <= value < vocab:
                ids[ours] = value
    return ids


def _rope_base(f: GGUFFile, arch: str) -> float:
    """``{arch}.rope.freq_base``: a number > 1 (RoPE's base; 1 or less has no rotation)."""
    key = f"{arch}.rope.freq_base"
    theta = _float(f, key, 10_000.0)
    if theta <= 1:
        raise f.error(key, f"must be a number > 1 (the RoPE base), got {theta}")
    return theta


def hf_config(f: GGUFFile) -> dict[str, object]:
    """The Hugging Face ``config.json`` a GGUF file's metadata stands for.

    Args:
        f: the file, read by :func:`~handformer.pretrained.gguf.read_gguf`.

    The dict carries both ``rope_parameters`` (transformers 5) and the older flat keys
    (``rope_theta``, ``rope_scaling``, Gemma 3's ``rope_local_base_freq`` and
    ``sliding_window_pattern``), and ``layer_types`` for the families with sliding windows.

    Raises:
        CheckpointError: for an unsupported architecture (the message names the supported
            ones), or a metadata key that is missing, of the wrong type or out of range.
    """
    arch = f.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise f.error("general.architecture", f"{arch!r} is not supported; supported "
                                              f"architectures: "
                                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if "rope_freqs.weight" in f.tensors:
        raise f.error("rope_freqs.weight", "per-frequency RoPE factors (Llama 3.1-style "
                                           "scaling) are not supported")
    d = _dims(f, arch)
    tied = _tied(f)
    if arch == "gpt2":
        eps = _float(f, "gpt2.attention.layer_norm_epsilon", 1e-5)
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": d.vocab, "n_embd": d.hidden, "n_layer": d.layers,
                "n_head": d.heads, "n_inner": d.ff, "n_positions": d.context,
                "n_ctx": d.context, "layer_norm_epsilon": eps,
                "activation_function": "gelu_new", "tie_word_embeddings": tied,
                **_token_ids(f, d.vocab)}
    theta = _rope_base(f, arch)
    rope_parameters, rope_scaling = _rope(f, arch, theta)
    eps = _float(f, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    config: dict[str, object] = {
        "vocab_size": d.vocab, "hidden_size": d.hidden, "intermediate_size": d.ff,
        "num_hidden_layers": d.layers, "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads, "head_dim": d.head_dim,
        "max_position_embeddings": d.context, "rms_norm_eps": eps, "rope_theta": theta,
        "rope_scaling": rope_scaling, "rope_parameters": rope_parameters,
        "tie_word_embeddings": tied, **_token_ids(f, d.vocab),
    }
    has = f.tensors.__contains__
    if arch in ("llama", "qwen2", "qwen3"):
        names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
        config.update(model_type=arch, architectures=[names[arch]], hidden_act="silu")
        if arch != "qwen2":  # Qwen2 always has q/k/v biases and no o bias
            config["attention_bias"] = has("blk.0.attn_q.bias")
        if arch == "llama":
            config["mlp_bias"] = has("blk.0.ffn_up.bias")
        else:
            config.update(use_sliding_window=False, sliding_window=None,
                          layer_types=["full_attention"] * d.layers)
        return config
    # gemma2, gemma3
    window = _int(f, f"{arch}.attention.sliding_window", 4096)
    large = d.layers == _GEMMA_27B_LAYERS[arch]
    config.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                  sliding_window=window, layer_types=_gemma_layer_types(f, arch, d.layers),
                  query_pre_attn_scalar=d.hidden // d.heads if large else d.head_dim)
    if arch == "gemma2":
        config.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                      attn_logit_softcapping=_float(f, "gemma2.attn_logit_softcapping", 50.0),
                      final_logit_softcapping=_float(f, "gemma2.final_logit_softcapping",
                                                     30.0))
        return config
    local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}
    config.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                  rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE,
                  sliding_window_pattern=GEMMA3_SLIDING_PATTERN,
                  rope_parameters={"sliding_attention": local, "full_attention": rope_parameters},
                  attn_logit_softcapping=None, final_logit_softcapping=None)
    return config


def _gemma_layer_types(f: GGUFFile, arch: str, layers: int) -> list[str]:
    """Gemma 2 alternates sliding and global layers; Gemma 3 has 5 sliding : 1 global
    (a per-layer ``{arch}.attention.sliding_window_pattern`` bool array overrides)."""
    key = f"{arch}.attention.sliding_window_pattern"
    if key in f.metadata:
        pattern = f.metadata[key]
        if f.value_types[key] != (GGUFValueType.ARRAY, GGUFValueType.BOOL) \
                or len(pattern) != layers:  # type: ignore[arg-type]
            raise f.error(key, f"must be an array of {layers} bools, got "
                               f"{_type_name(f, key)}")
        return ["sliding_attention" if s else "full_attention" for s in pattern]  # type: ignore
    period = 2 if arch == "gemma2" else GEMMA3_SLIDING_PATTERN
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(layers)]


def _tied(f: GGUFFile) -> bool:
    """True when the file has no ``output.weight``, or one byte-for-byte ``token_embd``'s."""
    out, emb = f.tensors.get("output.weight"), f.tensors["token_embd.weight"]
    if out is None:
        return True
    if (out.ggml_type, out.shape, out.nbytes) != (emb.ggml_type, emb.shape, emb.nbytes):
        return False
    a = np.memmap(f.path, dtype=np.uint8, mode="r", offset=out.offset, shape=(out.nbytes,))
    b = np.memmap(f.path, dtype=np.uint8, mode="r", offset=emb.offset, shape=(emb.nbytes,))
    step = 1 << 24
    return all(np.array_equal(a[i:i + step], b[i:i + step]) for i in range(0, out.nbytes, step))


# ---- tensor names and shapes ----------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """Where a GGUF tensor goes: its HF name, expected torch shape and fix-up."""

    hf_name: str
    shape: tuple[int, ...]
    fixup: str = ""  # "", "permute_q", "permute_k", "norm_minus_one", "transpose"


def _targets(f: GGUFFile, config: dict[str, object]) -> dict[str, _Target]:
    """Every tensor the file must hold, by GGUF name."""
    arch = f.architecture
    if arch == "gpt2":
        return _gpt2_targets(config)
    E, V, F = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    H, K, D = (config["num_attention_heads"], config["num_key_value_heads"],
               config["head_dim"])
    family = gguf_family_for(arch)  # the family module says what llama.cpp changed...
    model = _family_config(f, family, config)  # ...and which tensors the config implies
    norm = "norm_minus_one" if family.gguf.norms_plus_one else ""
    t = {"token_embd.weight": _Target("model.embed_tokens.weight", (V, E)),
         "output_norm.weight": _Target("model.norm.weight", (E,), norm)}
    if not config["tie_word_embeddings"]:
        t["output.weight"] = _Target("lm_head.weight", (V, E))
    attn_bias, out_bias, mlp_bias = model.qkv_bias, model.out_bias, model.mlp_bias
    qk_norm, sandwich, permute = model.qk_norm, model.sandwich_norm, family.gguf.permuted_qk
    for i in range(config["num_hidden_layers"]):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        a, m = h + "self_attn.", h + "mlp."
        layer = {
            "attn_q.weight": _Target(a + "q_proj.weight", (H * D, E), "permute_q" * permute),
            "attn_k.weight": _Target(a + "k_proj.weight", (K * D, E), "permute_k" * permute),
            "attn_v.weight": _Target(a + "v_proj.weight", (K * D, E)),
            "attn_output.weight": _Target(a + "o_proj.weight", (E, H * D)),
            "ffn_gate.weight": _Target(m + "gate_proj.weight", (F, E)),
            "ffn_up.weight": _Target(m + "up_proj.weight", (F, E)),
            "ffn_down.weight": _Target(m + "down_proj.weight", (E, F)),
            "attn_norm.weight": _Target(h + "input_layernorm.weight", (E,), norm),
        }
        if sandwich:
            layer.update({
                "post_attention_norm.weight": _Target(h + "post_attention_layernorm.weight",
                                                      (E,), norm),
                "ffn_norm.weight": _Target(h + "pre_feedforward_layernorm.weight", (E,), norm),
                "post_ffw_norm.weight": _Target(h + "post_feedforward_layernorm.weight", (E,),
                                                norm)})
        else:
            layer["ffn_norm.weight"] = _Target(h + "post_attention_layernorm.weight", (E,),
                                               norm)
        if attn_bias:
            layer["attn_q.bias"] = _Target(a + "q_proj.bias", (H * D,), "permute_q" * permute)
            layer["attn_k.bias"] = _Target(a + "k_proj.bias", (K * D,), "permute_k" * permute)
            layer["attn_v.bias"] = _Target(a + "v_proj.bias", (K * D,))
        if out_bias:
            layer["attn_output.bias"] = _Target(a + "o_proj.bias", (E,))
        if mlp_bias:
            for name, hf, n in (("ffn_gate", "gate_proj", F), ("ffn_up", "up_proj", F),
                                ("ffn_down", "down_proj", E)):
                layer[f"{name}.bias"] = _Target(f"{m}{hf}.bias", (n,))
        if qk_norm:
            layer["attn_q_norm.weight"] = _Target(a + "q_norm.weight", (D,), norm)
            layer["attn_k_norm.weight"] = _Target(a + "k_norm.weight", (D,), norm)
        t.update({g + k: v for k, v in layer.items()})
    if permute and D % 2:
        raise f.error(f"{arch}.attention.key_length", f"head dim {D} must be even for RoPE")
    return t


def _family_config(f: GGUFFile, family: Family, config: dict[str, object]) -> object:
    """The family's :class:`~handformer.CausalLMConfig` of the config the metadata stands for
    (its refusals as the file's)."""
    try:
        return family.config_from_hf(config)
    except ValueError as e:
        raise f.error("metadata", f"the {family.name} family refuses the config it implies: "
                                  f"{e}") from None


def _gpt2_targets(config: dict[str, object]) -> dict[str, _Target]:
    E, V, F, P = (config["n_embd"], config["vocab_size"], config["n_inner"],
                  config["n_positions"])
    t = {"token_embd.weight": _Target("transformer.wte.weight", (V, E)),
         "position_embd.weight": _Target("transformer.wpe.weight", (P, E)),
         "output_norm.weight": _Target("transformer.ln_f.weight", (E,)),
         "output_norm.bias": _Target("transformer.ln_f.bias", (E,))}
    if not config["tie_word_embeddings"]:
        t["output.weight"] = _Target("lm_head.weight", (V, E))
    for i in range(config["n_layer"]):
        g, h = f"blk.{i}.", f"transformer.h.{i}."
        t.update({
            g + "attn_norm.weight": _Target(h + "ln_1.weight", (E,)),
            g + "attn_norm.bias": _Target(h + "ln_1.bias", (E,)),
            g + "attn_qkv.weight": _Target(h + "attn.c_attn.weight", (3 * E, E), "transpose"),
            g + "attn_qkv.bias": _Target(h + "attn.c_attn.bias", (3 * E,)),
            g + "attn_output.weight": _Target(h + "attn.c_proj.weight", (E, E), "transpose"),
            g + "attn_output.bias": _Target(h + "attn.c_proj.bias", (E,)),
            g + "ffn_norm.weight": _Target(h + "ln_2.weight", (E,)),
            g + "ffn_norm.bias": _Target(h + "ln_2.bias", (E,)),
            g + "ffn_up.weight": _Target(h + "mlp.c_fc.weight", (F, E), "transpose"),
            g + "ffn_up.bias": _Target(h + "mlp.c_fc.bias", (F,)),
            g + "ffn_down.weight": _Target(h + "mlp.c_proj.weight", (E, F), "transpose"),
            g + "ffn_down.bias": _Target(h + "mlp.c_proj.bias", (E,)),
        })
    return t


def _check_tensors(f: GGUFFile, targets: dict[str, _Target]) -> None:
    """Refuse missing, unexpected and mis-shaped tensors (all named, in one line)."""
    problems = []
    missing = [n for n in targets if n not in f.tensors]
    if missing:
        problems.append(f"{len(missing)} missing: {_some(missing)}")
    unexpected = [n for n in f.tensors if n not in targets]
    if f.architecture == "gpt2" and "output.weight" in unexpected:  # a copy of token_embd
        unexpected.remove("output.weight")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_some(unexpected)}")
    shapes = [f"{n} {f.tensors[n].shape} (expected {t.shape})" for n, t in targets.items()
              if n in f.tensors and f.tensors[n].shape != t.shape]
    if shapes:
        problems.append(f"{len(shapes)} mis-shaped: {_some(shapes)}")
    if problems:
        raise f.error("tensors", f"do not match the {f.architecture} config from its metadata: "
                                 + "; ".join(problems))


def _some(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def llama_row_order(heads: int, head_dim: int) -> torch.Tensor:
    """Where each row of a llama.cpp-permuted Q or K projection goes back to.

    llama.cpp stores head ``h``'s rows in the order ``(i, j)`` for pair ``i < D/2`` and
    half ``j in {0, 1}``; Hugging Face's in the order ``(j, i)``. Row ``r`` of the file goes
    to row ``result[r]``.
    """
    hf = torch.arange(heads * head_dim).reshape(heads, 2, head_dim // 2)  # (H, 2, D/2): HF rows
    return hf.transpose(1, 2).reshape(-1)  # (H, D/2, 2) flattened: the file's row order


def gguf_to_hf(file: GGUFFile | str | os.PathLike, *, dtype: torch.dtype = torch.float32
               ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Read a GGUF file as a Hugging Face checkpoint: its config and its tensors.

    Args:
        file: a :class:`GGUFFile` or the path of a ``.gguf`` file.
        dtype: floating dtype of the tensors (dequantized in float32, rounded once).

    Returns:
        ``(config, state)``: ``config`` a ``config.json``-style dict (``model_type`` one of
        ``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``gpt2``), ``state`` the
        tensors under the Hugging Face checkpoint's names, llama.cpp's fix-ups undone. A tied
        head has no ``lm_head.weight`` entry (as in a Hugging Face checkpoint).

    Raises:
        CheckpointError: for a damaged file (see :func:`read_gguf`), an unsupported
            architecture (the message names the supported ones), metadata that is missing or
            of the wrong type, or tensors that are missing, unexpected or mis-shaped for the
            config (named in the file's names).
        TypeError: for a non-floating ``dtype``.
    """
    config, state = gguf_state(file, dtype=dtype)
    return config, {name: state[name] for name in state}


def gguf_state(file: GGUFFile | str | os.PathLike, *, dtype: torch.dtype = torch.float32
               ) -> tuple[dict[str, object], GGUFState]:
    """As :func:`gguf_to_hf`, with the tensors dequantized one at a time, when asked for.

    Args:
        file, dtype: as :func:`gguf_to_hf`.

    A loader that installs each tensor before asking for the next holds one model's worth
    of memory at the peak (:func:`handformer.pretrained.load_lm` reads files so).

    Returns:
        ``(config, state)``: ``state`` a :class:`GGUFState`.

    Raises:
        As :func:`gguf_to_hf`; all of them before any tensor is dequantized.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    f = file if isinstance(file, GGUFFile) else read_gguf(file)
    config = hf_config(f)
    targets = _targets(f, config)
    _check_tensors(f, targets)
    return config, GGUFState(f, config, targets, dtype)


# read_rows' chunks: 1 MB of float32 (gguf.quants makes a few temporaries of that size)
_ROWS_CHUNK_VALUES = 1 << 18
_FOUR_BIT = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                       GGMLQuantizationType.Q4_K})


class GGUFState(Mapping):
    """A GGUF file's tensors under Hugging Face's names, dequantized (fix-ups undone) on
    access: ``state[name]`` is a fresh tensor each time. Built by :func:`gguf_state`.

    Args:
        f, config, targets, dtype: the file, its config, the tensors it holds by GGUF name,
            and the dtype to dequantize to (as :func:`gguf_state` passes them).

    Attributes:
        header: ``{hf_name: {"dtype", "shape"}}`` as a safetensors header, read from the
            file's tensor infos without dequantizing anything.
    """

    def __init__(self, f: GGUFFile, config: dict[str, object], targets: dict[str, _Target],
                 dtype: torch.dtype) -> None:
        # the file without its metadata, which the tensors do not need (a vocabulary of
        # 49,152 to 262,144 tokens is 9 to 37 MB of Python strings)
        self._file = dataclasses.replace(f, metadata={}, value_types={})
        self._dtype = dtype
        self._where = {t.hf_name: (name, t.fixup) for name, t in targets.items()}
        dtype_name = DTYPE_NAMES.get(dtype, str(dtype))
        self.header = {t.hf_name: {"dtype": dtype_name,
                                   "shape": list(t.shape[::-1] if t.fixup == "transpose"
                                                 else t.shape)}
                       for t in targets.values()}
        self._orders: dict[str, torch.Tensor] = {}
        if any(t.fixup == "permute_q" for t in targets.values()):
            heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
            self._orders = {"permute_q": llama_row_order(heads, config["head_dim"]),
                            "permute_k": llama_row_order(kv, config["head_dim"])}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read_into(name, None)

    def read_into(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        """``state[name]`` written into ``out`` (a CPU tensor of its shape and dtype) when
        given, without a second copy where the fix-up allows (all but GPT-2's transposes).

        Raises:
            KeyError: for a name the file does not hold.
            ValueError: for an ``out`` of the wrong shape, dtype or device.
        """
        gguf_name, fixup = self._where[name]
        f, info, dtype = self._file, self._file.tensors[gguf_name], self._dtype
        if fixup == "transpose" or (fixup in self._orders and len(info.shape) != 2):
            tensor = (dequantize_tensor(f, info, dtype=dtype).t() if fixup == "transpose"
                      else _permuted(f, info, self._orders[fixup], dtype))  # (in, out); bias
            return tensor if out is None else out.copy_(tensor)
        return dequantize_tensor(f, info, dtype=dtype, row_order=self._orders.get(fixup),
                                 offset=-1.0 if fixup == "norm_minus_one" else 0.0, out=out)

    def read_rows(self, name: str) -> Iterator[tuple[slice | torch.Tensor, torch.Tensor]]:
        """``state[name]``, a 2-D weight, as chunks of float32 rows: ``(rows, values)``
        pairs, ``rows`` a slice or an index tensor of where ``values`` go (each row once);
        nothing the size of the whole tensor is made (a quantizing loader's reader). A
        transposed (GPT-2) tensor comes whole, as one chunk.

        Raises:
            KeyError: for a name the file does not hold.
        """
        gguf_name, fixup = self._where[name]
        f, info = self._file, self._file.tensors[gguf_name]
        if fixup == "transpose" or len(info.shape) != 2 or fixup == "norm_minus_one":
            yield slice(None), self[name].float()
            return
        order = self._orders.get(fixup)
        for rows, values in dequantize_chunks(f, info, row_order=order,
                                              chunk_values=_ROWS_CHUNK_VALUES):
            yield (rows if isinstance(rows, slice) else torch.from_numpy(rows),
                   torch.from_numpy(values))

    def four_bit(self, name: str) -> bool:
        """Whether the file stores ``state[name]`` in 4-bit blocks (Q4_0, Q4_1, Q4_K): what
        ``quantize="int4"`` keeps; a tensor stored wider stays int8 there."""
        info = self._file.tensors[self._where[name][0]]
        return info.ggml_type in _FOUR_BIT

    def row_source(self, name: str) -> GGUFRows | None:
        """The rows of ``state[name]`` read from the file when looked up
        (:class:`~handformer.pretrained.gguf.dequant.GGUFRows`), or None for a tensor with a
        fix-up or not 2-D (it must be read whole)."""
        gguf_name, fixup = self._where[name]
        info = self._file.tensors[gguf_name]
        return None if fixup or len(info.shape) != 2 else GGUFRows(self._file, info)

    def __iter__(self) -> Iterator[str]:
        return iter(self.header)

    def __len__(self) -> int:
        return len(self.header)


def _permuted(f: GGUFFile, info: TensorInfo, order: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """Dequantize a llama.cpp-permuted Q/K weight (rows) or bias (elements) into HF order."""
    if len(info.shape) == 2:
        return dequantize_tensor(f, info, dtype=dtype, row_order=order)
    bias = dequantize_tensor(f, info, dtype=dtype)
    out = torch.empty_like(bias)
    out[order] = bias
    return out
