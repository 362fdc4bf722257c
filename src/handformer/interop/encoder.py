"""``torch.nn`` <-> handformer converters: the table, attention and the encoder layer.

Holds the conversion tables :data:`FROM_TORCH` / :data:`TO_TORCH` (dicts from type to
converter), :func:`from_torch` / :func:`to_torch` that look them up, the helpers every
converter shares, and the converters of ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer``. :mod:`handformer.interop.decoder` registers the decoder side
beside these; :mod:`handformer.interop` imports both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from handformer.attention.kinds import FullAttention
from handformer.layers import EncoderLayer, MultiHeadAttention

__all__ = ["from_torch", "to_torch", "FROM_TORCH", "TO_TORCH", "copy_linear", "copy_norm",
           "mha_from_torch", "mha_to_torch", "activation_name"]

FROM_TORCH: dict[type, Callable[[nn.Module], nn.Module]] = {}
TO_TORCH: dict[type, Callable[[nn.Module], nn.Module]] = {}


def from_torch(module: nn.Module) -> nn.Module:
    """Convert a ``torch.nn`` module to the equivalent handformer module (weights copied).

    Supported: ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``, plus
    ``nn.TransformerDecoderLayer``, ``nn.TransformerDecoder`` and ``nn.Transformer`` once
    :mod:`handformer.interop.decoder` is imported (``import handformer.interop`` does). The
    result is in the same train/eval mode as ``module``.

    Args:
        module: the ``torch.nn`` module to convert.

    Raises:
        TypeError: for unsupported module types.
        ValueError: for options handformer does not implement (e.g. ``add_bias_kv``).
    """
    converter = FROM_TORCH.get(type(module))
    if converter is None:
        raise TypeError(
            f"from_torch cannot convert {type(module).__name__}; supported: "
            f"{', '.join(t.__name__ for t in FROM_TORCH)}"
        )
    out = converter(module)
    return _like(out, module)


def to_torch(module: nn.Module) -> nn.Module:
    """Convert a handformer module to the equivalent ``torch.nn`` module (batch_first=True).

    Args:
        module: the handformer module to convert (the types :func:`from_torch` returns).

    Raises:
        TypeError: for unsupported module types.
        ValueError: for modules using an attention kind torch does not have.
    """
    converter = TO_TORCH.get(type(module))
    if converter is None:
        raise TypeError(
            f"to_torch cannot convert {type(module).__name__}; supported: "
            f"{', '.join(t.__name__ for t in TO_TORCH)}"
        )
    out = converter(module)
    return _like(out, module)


def _like(out: nn.Module, module: nn.Module) -> nn.Module:
    """``out`` moved to ``module``'s device and dtype, in its train/eval mode."""
    p = next(module.parameters(), None)
    if p is not None:
        out = out.to(device=p.device, dtype=p.dtype)
    return out.train(module.training)


@torch.no_grad()
def copy_linear(dst: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    dst.weight.copy_(weight)
    if dst.bias is not None:
        dst.bias.copy_(bias)


# ---- MultiheadAttention --------------------------------------------------------------------

def mha_from_torch(m: nn.MultiheadAttention) -> MultiHeadAttention:
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError("from_torch: add_bias_kv and add_zero_attn are not supported")
    E = m.embed_dim
    bias = m.in_proj_bias is not None
    out = MultiHeadAttention(E, m.num_heads, dropout=m.dropout, bias=bias, kdim=m.kdim,
                             vdim=m.vdim)
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)  # (3E, E) -> 3 x (E, E)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    bq, bk, bv = m.in_proj_bias.chunk(3) if bias else (None, None, None)
    copy_linear(out.q_proj, wq, bq)
    copy_linear(out.k_proj, wk, bk)
    copy_linear(out.v_proj, wv, bv)
    copy_linear(out.out_proj, m.out_proj.weight, m.out_proj.bias)
    return out


@torch.no_grad()
def mha_to_torch(m: MultiHeadAttention) -> nn.MultiheadAttention:
    if not isinstance(m.attention, FullAttention):
        raise ValueError(
            f"to_torch: torch.nn.MultiheadAttention has no {type(m.attention).__name__}"
        )
    if getattr(m, "rotary", None) is not None:
        raise ValueError("to_torch: torch.nn.MultiheadAttention has no rotary embedding")
    bias = m.q_proj.bias is not None
    out = nn.MultiheadAttention(m.d_model, m.num_heads, dropout=m.dropout, bias=bias,
                                kdim=m.kdim, vdim=m.vdim, batch_first=True)
    if out._qkv_same_embed_dim:
        out.in_proj_weight.copy_(
            torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])  # (3E, E)
        )
    else:
        out.q_proj_weight.copy_(m.q_proj.weight)
        out.k_proj_weight.copy_(m.k_proj.weight)
        out.v_proj_weight.copy_(m.v_proj.weight)
    if bias:
        out.in_proj_bias.copy_(torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]))
    copy_linear(out.out_proj, m.out_proj.weight, m.out_proj.bias)
    return out


# ---- TransformerEncoderLayer ---------------------------------------------------------------

def activation_name(activation: object) -> str:
    """Name of a torch activation (function or module) as handformer spells it."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    raise ValueError(f"unsupported activation {activation!r}; use relu or gelu")


@torch.no_grad()
def copy_norm(dst: nn.LayerNorm, src: nn.LayerNorm) -> None:
    """Copy a LayerNorm's affine parameters."""
    dst.weight.copy_(src.weight)
    if dst.bias is not None:
        dst.bias.copy_(src.bias)


def _encoder_layer_from_torch(m: nn.TransformerEncoderLayer) -> EncoderLayer:
    out = EncoderLayer(
        m.linear1.in_features, m.self_attn.num_heads, m.linear1.out_features,
        dropout=m.dropout.p, activation=activation_name(m.activation), norm_first=m.norm_first,
        layer_norm_eps=m.norm1.eps, bias=m.linear1.bias is not None,
    )
    out.attn = mha_from_torch(m.self_attn)  # torch's names on the right, ours on the left
    copy_linear(out.mlp.linear1, m.linear1.weight, m.linear1.bias)
    copy_linear(out.mlp.linear2, m.linear2.weight, m.linear2.bias)
    copy_norm(out.ln1, m.norm1)
    copy_norm(out.ln2, m.norm2)
    return out


def _encoder_layer_to_torch(m: EncoderLayer) -> nn.TransformerEncoderLayer:
    bias = m.mlp.linear1.bias is not None
    activation = {"relu": "relu", "gelu": "gelu", "gelu_tanh": nn.GELU(approximate="tanh")}
    out = nn.TransformerEncoderLayer(
        m.d_model, m.attn.num_heads, m.mlp.linear1.out_features,
        dropout=m.dropout1.p, activation=activation[m.mlp.activation_name],
        layer_norm_eps=m.ln1.eps, batch_first=True, norm_first=m.norm_first, bias=bias,
    )
    out.self_attn = mha_to_torch(m.attn)  # torch's names on the left, ours on the right
    copy_linear(out.linear1, m.mlp.linear1.weight, m.mlp.linear1.bias)
    copy_linear(out.linear2, m.mlp.linear2.weight, m.mlp.linear2.bias)
    copy_norm(out.norm1, m.ln1)
    copy_norm(out.norm2, m.ln2)
    return out


FROM_TORCH[nn.MultiheadAttention] = mha_from_torch
FROM_TORCH[nn.TransformerEncoderLayer] = _encoder_layer_from_torch
TO_TORCH[MultiHeadAttention] = mha_to_torch
TO_TORCH[EncoderLayer] = _encoder_layer_to_torch
