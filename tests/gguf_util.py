"""Helpers for the GGUF tests: small files written with ``gguf.GGUFWriter``.

- :func:`write_gguf` writes metadata and tensors (float arrays, or raw quantized blocks);
- :func:`tiny_llama_gguf` a complete, loadable tiny ``llama`` file (the fuzzing target);
- :func:`random_blocks` random quantized blocks with finite scale fields, for the types
  ``gguf`` cannot quantize (K-quants, IQ types);
- :func:`hf_to_gguf` a Hugging Face checkpoint written as llama.cpp's converter would (its
  metadata keys, tensor names, the Q/K permutation for ``llama`` and ``w + 1`` Gemma norms);
- :func:`header_fields` the byte offset of every header field of a valid file, to corrupt one.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

Q = GGMLQuantizationType

# Byte offsets of the float16 scale fields inside one block of each type (ggml's block
# structs): random bytes elsewhere are valid quants, random bytes here could be inf or NaN.
F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ1_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,),
}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> np.ndarray:
    """``(rows, row_bytes)`` uint8: random blocks of ``qtype`` whose scales are finite."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    data = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for at in F16_FIELDS.get(qtype, ()):
        scale = rng.uniform(-2.0, 2.0, size=n_blocks).astype(np.float16)
        data[:, at:at + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.IQ1_M:  # the f16 scale is the top nibbles of 4 u16s (bytes 48..55)
        data[:, 55] &= 0xBF  # clear the scale's exponent top bit: finite
    elif qtype == Q.MXFP4:  # byte 0: an E8M0 power-of-two scale
        data[:, 0] = rng.integers(110, 140, size=n_blocks)
    elif qtype == Q.BF16:  # every value is a bf16: keep its exponent below all-ones
        data[:, 1] &= 0xBF
    return data.reshape(rows, cols // block * type_size)


def write_gguf(path: Path, arch: str, metadata: dict[str, tuple[GGUFValueType, object]],
               tensors: dict[str, np.ndarray | tuple[np.ndarray, GGMLQuantizationType]],
               *, alignment: int | None = None) -> Path:
    """Write a GGUF file: ``metadata`` key -> (type, value); ``tensors`` name -> float32/16
    array (torch order) or ``(raw uint8 rows, ggml type)``."""
    w = GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vtype, value) in metadata.items():
        if vtype == GGUFValueType.ARRAY:
            w.add_array(key, value)  # type: ignore[arg-type]
        else:
            w.add_key_value(key, value, vtype)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            raw, qtype = t
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


U32, F32, STR, ARR, BOOL = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING,
                            GGUFValueType.ARRAY, GGUFValueType.BOOL)


def llama_metadata(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, kv: int,
                   ff: int, head_dim: int | None = None) -> dict[str, tuple]:
    """The metadata llama.cpp's converter writes for a decoder (and a toy vocabulary)."""
    meta = {f"{arch}.context_length": (U32, 64), f"{arch}.embedding_length": (U32, hidden),
            f"{arch}.block_count": (U32, layers), f"{arch}.feed_forward_length": (U32, ff),
            f"{arch}.attention.head_count": (U32, heads),
            f"{arch}.attention.head_count_kv": (U32, kv),
            f"{arch}.rope.freq_base": (F32, 10000.0),
            f"{arch}.attention.layer_norm_rms_epsilon": (F32, 1e-6),
            "tokenizer.ggml.model": (STR, "gpt2"),
            "tokenizer.ggml.tokens": (ARR, [f"t{i}" for i in range(vocab)]),
            "tokenizer.ggml.bos_token_id": (U32, 1), "tokenizer.ggml.eos_token_id": (U32, 2)}
    if head_dim is not None:
        meta[f"{arch}.attention.key_length"] = (U32, head_dim)
        meta[f"{arch}.attention.value_length"] = (U32, head_dim)
    return meta


def tiny_llama_gguf(path: Path, *, qtype: GGMLQuantizationType = Q.Q8_0, seed: int = 0) -> Path:
    """A complete tiny ``llama`` GGUF (vocab 16, hidden 32, 1 layer, 4 heads, 2 KV heads)."""
    rng = np.random.default_rng(seed)
    E, V, F, H, K, D = 32, 16, 64, 4, 2, 8

    def mat(rows: int, cols: int) -> np.ndarray | tuple[np.ndarray, GGMLQuantizationType]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == Q.F32:
            return w
        from gguf import quants

        return quants.quantize(w, qtype), qtype

    tensors = {"token_embd.weight": mat(V, E),
               "output_norm.weight": rng.standard_normal(E).astype(np.float32),
               "blk.0.attn_norm.weight": rng.standard_normal(E).astype(np.float32),
               "blk.0.ffn_norm.weight": rng.standard_normal(E).astype(np.float32),
               "blk.0.attn_q.weight": mat(H * D, E), "blk.0.attn_k.weight": mat(K * D, E),
               "blk.0.attn_v.weight": mat(K * D, E), "blk.0.attn_output.weight": mat(E, H * D),
               "blk.0.ffn_gate.weight": mat(F, E), "blk.0.ffn_up.weight": mat(F, E),
               "blk.0.ffn_down.weight": mat(E, F)}
    meta = llama_metadata("llama", vocab=V, hidden=E, layers=1, heads=H, kv=K, ff=F)
    meta["general.alignment"] = (U32, 32)
    meta["tokenizer.ggml.scores"] = (ARR, [float(i) for i in range(V)])
    meta["tokenizer.ggml.add_bos_token"] = (BOOL, True)
    return write_gguf(path, "llama", meta, tensors)


# ---- Hugging Face -> GGUF, as llama.cpp's convert_hf_to_gguf.py does -------------------------


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K permutation: per head, rows (half j, pair i) -> (pair i, half j)."""
    shape = w.shape
    return (w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
            .transpose(1, 2).reshape(shape).contiguous())


_LAYER_NAMES = {  # HF suffix -> GGUF suffix, decoder families
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
}
_NORMS = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "gemma": {"post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm"},
}


def hf_name_to_gguf(name: str, gemma: bool) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = name.split(".", 3)
    module, param = rest.rsplit(".", 1)
    table = {**_LAYER_NAMES, **_NORMS["gemma" if gemma else "llama"]}
    return f"blk.{i}.{table[module]}.{param}"


def hf_to_gguf(state: dict[str, torch.Tensor], config: dict, arch: str, path: Path,
               *, metadata: dict | None = None) -> Path:
    """Write an HF decoder checkpoint (llama/qwen2/qwen3/gemma2/gemma3) as float32 GGUF."""
    gemma = arch.startswith("gemma")
    H, K = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for name, t in state.items():
        t = t.detach().float()
        if arch == "llama" and ".q_proj." in name:
            t = llamacpp_permute(t, H)
        elif arch == "llama" and ".k_proj." in name:
            t = llamacpp_permute(t, K)
        if gemma and name.endswith("norm.weight"):
            t = t + 1
        tensors[hf_name_to_gguf(name, gemma)] = t.numpy()
    meta = llama_metadata(arch, vocab=config["vocab_size"], hidden=config["hidden_size"],
                          layers=config["num_hidden_layers"], heads=H, kv=K,
                          ff=config["intermediate_size"], head_dim=config.get("head_dim"))
    meta[f"{arch}.context_length"] = (U32, config["max_position_embeddings"])
    meta[f"{arch}.attention.layer_norm_rms_epsilon"] = (F32, config["rms_norm_eps"])
    meta.update(metadata or {})
    return write_gguf(path, arch, meta, tensors)


# ---- header layout of a valid file (to corrupt one field at a time) --------------------------


def header_fields(data: bytes) -> dict[str, int]:
    """Byte offset of every header field of a valid little-endian GGUF file.

    Keys: ``magic``, ``version``, ``tensor_count``, ``kv_count``, ``kv:<key>:len``,
    ``kv:<key>:type``, ``kv:<key>:value`` (for arrays ``kv:<key>:etype``, ``kv:<key>:count``
    and ``kv:<key>:item1`` for a string array's second element), ``ti:<name>:len``,
    ``ti:<name>:n_dims``, ``ti:<name>:dim0``, ``ti:<name>:type``, ``ti:<name>:offset``, and
    ``data`` (where the tensor infos end).
    """
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    out = {"magic": 0, "version": 4, "tensor_count": 8, "kv_count": 16}
    n_t, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8:at + 8 + n].decode(), at + 8 + n

    for _ in range(n_kv):
        start = pos
        key, pos = string(pos)
        out[f"kv:{key}:len"] = start
        out[f"kv:{key}:type"] = pos
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        out[f"kv:{key}:value"] = pos
        if vtype == 8:
            _, pos = string(pos)
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, pos)
            out[f"kv:{key}:etype"], out[f"kv:{key}:count"] = pos, pos + 4
            pos += 12
            for j in range(count):
                if j == 1:
                    out[f"kv:{key}:item1"] = pos
                if etype == 8:
                    _, pos = string(pos)
                else:
                    pos += sizes[etype]
        else:
            pos += sizes[vtype]
    for _ in range(n_t):
        start = pos
        name, pos = string(pos)
        out[f"ti:{name}:len"] = start
        out[f"ti:{name}:n_dims"] = pos
        (n_dims,) = struct.unpack_from("<I", data, pos)
        out[f"ti:{name}:dim0"] = pos + 4
        pos += 4 + 8 * n_dims
        out[f"ti:{name}:type"] = pos
        out[f"ti:{name}:offset"] = pos + 4
        pos += 12
    out["data"] = pos
    return out


def gpt2_to_gguf(state: dict[str, torch.Tensor], config: dict, path: Path,
                 *, metadata: dict | None = None) -> Path:
    """Write an HF GPT-2 checkpoint as llama.cpp does: Conv1D weights transposed to
    ``(out, in)``, and ``output.weight`` a copy of the embedding (``metadata``: keys to add
    or replace)."""
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
             "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    top = {"transformer.wte.weight": "token_embd.weight",
           "transformer.wpe.weight": "position_embd.weight",
           "transformer.ln_f.weight": "output_norm.weight",
           "transformer.ln_f.bias": "output_norm.bias"}
    tensors = {}
    for name, t in state.items():
        t = t.detach().float()
        if name in top:
            tensors[top[name]] = t.numpy()
            continue
        if name == "lm_head.weight":
            continue
        _, _, i, rest = name.split(".", 3)
        module, param = rest.rsplit(".", 1)
        if param == "weight" and t.dim() == 2:
            t = t.t().contiguous()
        tensors[f"blk.{i}.{names[module]}.{param}"] = t.numpy()
    tensors["output.weight"] = tensors["token_embd.weight"].copy()
    E = config["n_embd"]
    meta = {"gpt2.block_count": (U32, config["n_layer"]),
            "gpt2.context_length": (U32, config["n_positions"]),
            "gpt2.embedding_length": (U32, E), "gpt2.feed_forward_length": (U32, 4 * E),
            "gpt2.attention.head_count": (U32, config["n_head"]),
            "gpt2.attention.layer_norm_epsilon": (F32, config["layer_norm_epsilon"]),
            **(metadata or {})}
    return write_gguf(path, "gpt2", meta, tensors)


# ---- damaged files for the error catalogue (docs/errors.md) ----------------------------------

HUGE = (1 << 64) - 1
_DAMAGE: dict[str, tuple[str, str, object]] = {  # kind -> (field, struct format, value)
    "magic": ("magic", "<4s", b"GGML"),
    "version": ("version", "<I", 1),
    "big-endian": ("version", "<I", 3 << 24),
    "tensor-count": ("tensor_count", "<Q", HUGE),
    "string-length": ("kv:tokenizer.ggml.tokens:item1", "<Q", 1 << 40),
    "n-dims": ("ti:token_embd.weight:n_dims", "<I", 5),
    "type": ("ti:token_embd.weight:type", "<I", 99),
    "offset": ("ti:blk.0.ffn_down.weight:offset", "<Q", 1 << 40),
    "alignment": ("kv:general.alignment:value", "<I", 48),
    "int-tensor": ("ti:output_norm.weight:type", "<I", 26),  # I32: same size as F32
    "head-dim": ("kv:llama.attention.head_count:value", "<I", 32),  # head dim 32 / 32 = 1
    "context-length": ("kv:llama.context_length:value", "<I", 1 << 31),  # beyond 2**31 - 1
    "rope-base": ("kv:llama.rope.freq_base:value", "<f", 1.0),  # no rotation
}


def damaged_gguf(folder: Path, kind: str) -> Path:
    """The tiny llama file with one kind of damage (see ``_DAMAGE``, and ``truncated``,
    ``overflow``, ``architecture``, ``missing-key``, ``missing-tensor``, ``nan``)."""
    path = folder / f"damaged-{kind}.gguf"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    data = bytearray(tiny_llama_gguf(folder / "tiny-llama.gguf").read_bytes())
    fields = header_fields(bytes(data))
    if kind in _DAMAGE:
        field, fmt, value = _DAMAGE[kind]
        struct.pack_into(fmt, data, fields[field], value)
    elif kind == "truncated":
        data = data[:fields["ti:blk.0.attn_q.weight:len"] + 20]
    elif kind == "overflow":
        struct.pack_into("<QQ", data, fields["ti:token_embd.weight:dim0"], 1 << 32, 1 << 32)
    elif kind == "architecture":
        data = data.replace(b"llama", b"mamba")
    elif kind == "missing-key":
        data = data.replace(b"llama.block_count", b"llama.layer_count")  # same length
    elif kind == "missing-tensor":
        data = data.replace(b"blk.0.ffn_down.weight", b"blk.0.ffn_down.weighs")
    elif kind == "nan":  # the first Q8_0 block's float16 scale of token_embd: NaN
        from gguf import GGUFReader

        at = next(t.data_offset for t in GGUFReader(folder / "tiny-llama.gguf").tensors
                  if t.name == "token_embd.weight")
        data[at:at + 2] = np.array([np.nan], np.float16).tobytes()
    else:
        raise ValueError(f"unknown damage {kind!r}")
    path.write_bytes(bytes(data))
    return path
