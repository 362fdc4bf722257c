"""``torch.nn`` <-> handformer converters for the decoder side.

Registers ``nn.TransformerDecoderLayer``, ``nn.TransformerDecoder`` and ``nn.Transformer`` in
the tables of :mod:`handformer.interop.encoder` (imports go one way: this module imports that
one, never the reverse; :mod:`handformer.interop` imports both, so ``from_torch`` /
``to_torch`` cover them).

torch's decoder layer is causal only when given a ``tgt_mask``; handformer's is causal by
default (``causal=True``). Converted torch modules are batch-first.
"""

from __future__ import annotations

import torch
from torch import nn

from handformer.decoder_layer import DecoderLayer
from handformer.interop.encoder import (
    FROM_TORCH,
    TO_TORCH,
    activation_name,
    copy_linear,
    copy_norm,
    mha_from_torch,
    mha_to_torch,
)
from handformer.models.decoder import Decoder
from handformer.models.transformer import Transformer

__all__: list[str] = []

_TORCH_ACTIVATION = {"relu": "relu", "gelu": "gelu"}


def _torch_activation(name: str) -> object:
    return _TORCH_ACTIVATION.get(name) or nn.GELU(approximate="tanh")


def _norm_from(src: nn.LayerNorm) -> nn.LayerNorm:
    out = nn.LayerNorm(src.normalized_shape, eps=src.eps, bias=src.bias is not None)
    copy_norm(out, src)
    return out


def _check_full(m: DecoderLayer) -> None:
    if m.cross_attn is None:
        raise ValueError("to_torch: torch.nn.TransformerDecoderLayer always has "
                         "cross-attention; this DecoderLayer has cross_attention=False")
    if m.self_attn.rotary is not None:
        raise ValueError("to_torch: torch.nn.TransformerDecoderLayer has no rotary embedding")


# ---- TransformerDecoderLayer ---------------------------------------------------------------

def _decoder_layer_from_torch(m: nn.TransformerDecoderLayer) -> DecoderLayer:
    out = DecoderLayer(
        m.linear1.in_features, m.self_attn.num_heads, m.linear1.out_features,
        dropout=m.dropout.p, activation=activation_name(m.activation), norm_first=m.norm_first,
        layer_norm_eps=m.norm1.eps, bias=m.linear1.bias is not None,
    )
    out.self_attn = mha_from_torch(m.self_attn)
    out.cross_attn = mha_from_torch(m.multihead_attn)
    copy_linear(out.ff.linear1, m.linear1.weight, m.linear1.bias)
    copy_linear(out.ff.linear2, m.linear2.weight, m.linear2.bias)
    for name in ("norm1", "norm2", "norm3"):
        copy_norm(getattr(out, name), getattr(m, name))
    return out


def _decoder_layer_to_torch(m: DecoderLayer) -> nn.TransformerDecoderLayer:
    _check_full(m)
    out = nn.TransformerDecoderLayer(
        m.d_model, m.self_attn.num_heads, m.ff.linear1.out_features, dropout=m.dropout1.p,
        activation=_torch_activation(m.ff.activation_name), layer_norm_eps=m.norm1.eps,
        batch_first=True, norm_first=m.norm_first, bias=m.ff.linear1.bias is not None,
    )
    out.self_attn = mha_to_torch(m.self_attn)
    out.multihead_attn = mha_to_torch(m.cross_attn)
    copy_linear(out.linear1, m.ff.linear1.weight, m.ff.linear1.bias)
    copy_linear(out.linear2, m.ff.linear2.weight, m.ff.linear2.bias)
    for name in ("norm1", "norm2", "norm3"):
        copy_norm(getattr(out, name), getattr(m, name))
    return out


# ---- TransformerDecoder --------------------------------------------------------------------

def _decoder_from_torch(m: nn.TransformerDecoder) -> Decoder:
    layers = [_decoder_layer_from_torch(layer) for layer in m.layers]
    out = Decoder(layers[0], len(layers),
                  final_norm=False if m.norm is None else _norm_from(m.norm))
    out.layers = nn.ModuleList(layers)
    return out


def _decoder_to_torch(m: Decoder) -> nn.TransformerDecoder:
    layers = [_decoder_layer_to_torch(layer) for layer in m.layers]
    norm = None if m.norm is None else _norm_from(m.norm)
    out = nn.TransformerDecoder(layers[0], len(layers), norm=norm)
    out.layers = nn.ModuleList(layers)
    return out


# ---- Transformer ---------------------------------------------------------------------------

@torch.no_grad()
def _transformer_from_torch(m: nn.Transformer) -> Transformer:
    enc_layers = [FROM_TORCH[nn.TransformerEncoderLayer](layer) for layer in m.encoder.layers]
    dec_layers = [_decoder_layer_from_torch(layer) for layer in m.decoder.layers]
    first = dec_layers[0]
    out = Transformer(first.d_model, first.self_attn.num_heads, 1, 1,
                      first.ff.linear1.out_features, dropout=first.dropout1.p,
                      activation=first.ff.activation_name, norm_first=first.norm_first,
                      layer_norm_eps=first.norm1.eps, bias=first.ff.linear1.bias is not None)
    out.encoder.layers = nn.ModuleList(enc_layers)
    out.decoder.layers = nn.ModuleList(dec_layers)
    out.encoder.norm = None if m.encoder.norm is None else _norm_from(m.encoder.norm)
    out.decoder.norm = None if m.decoder.norm is None else _norm_from(m.decoder.norm)
    return out


@torch.no_grad()
def _transformer_to_torch(m: Transformer) -> nn.Transformer:
    first = m.decoder.layers[0]
    _check_full(first)
    enc_layers = [TO_TORCH[type(layer)](layer) for layer in m.encoder.layers]
    dec_layers = [_decoder_layer_to_torch(layer) for layer in m.decoder.layers]
    out = nn.Transformer(
        m.d_model, m.num_heads, 1, 1, first.ff.linear1.out_features, first.dropout1.p,
        activation=_torch_activation(first.ff.activation_name),
        layer_norm_eps=first.norm1.eps, batch_first=True, norm_first=first.norm_first,
        bias=first.ff.linear1.bias is not None,
    )
    out.encoder.layers = nn.ModuleList(enc_layers)
    out.encoder.num_layers = len(enc_layers)
    out.decoder.layers = nn.ModuleList(dec_layers)
    out.decoder.num_layers = len(dec_layers)
    out.encoder.norm = None if m.encoder.norm is None else _norm_from(m.encoder.norm)
    out.decoder.norm = None if m.decoder.norm is None else _norm_from(m.decoder.norm)
    return out


FROM_TORCH[nn.TransformerDecoderLayer] = _decoder_layer_from_torch
FROM_TORCH[nn.TransformerDecoder] = _decoder_from_torch
FROM_TORCH[nn.Transformer] = _transformer_from_torch
TO_TORCH[DecoderLayer] = _decoder_layer_to_torch
TO_TORCH[Decoder] = _decoder_to_torch
TO_TORCH[Transformer] = _transformer_to_torch
