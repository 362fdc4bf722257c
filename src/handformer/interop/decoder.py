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
from handformer.norms import LayerNorm

__all__: list[str] = []

_TORCH_ACTIVATION = {"relu": "relu", "gelu": "gelu"}


def _torch_activation(name: str) -> object:
    return _TORCH_ACTIVATION.get(name) or nn.GELU(approximate="tanh")


def _norm_from(src: nn.LayerNorm, *, ours: bool = False) -> nn.LayerNorm:
    """A copy of a final norm: handformer's LayerNorm (with its hook points) when ``ours``,
    else torch's."""
    bias = src.bias is not None
    out = (LayerNorm(src.normalized_shape[0], eps=src.eps, bias=bias) if ours
           else nn.LayerNorm(src.normalized_shape, eps=src.eps, bias=bias))
    copy_norm(out, src)
    return out


def _check_full(m: DecoderLayer) -> None:
    if m.cross_attn is None:
        raise ValueError("to_torch: torch.nn.TransformerDecoderLayer always has "
                         "cross-attention; this DecoderLayer has cross_attention=False")
    if m.attn.rotary is not None:
        raise ValueError("to_torch: torch.nn.TransformerDecoderLayer has no rotary embedding")


# torch's TransformerDecoderLayer name -> handformer's (DecoderLayer's table)
_NORMS = {"norm1": "ln1", "norm2": "ln_cross", "norm3": "ln2"}


# ---- TransformerDecoderLayer ---------------------------------------------------------------

def _decoder_layer_from_torch(m: nn.TransformerDecoderLayer) -> DecoderLayer:
    out = DecoderLayer(
        m.linear1.in_features, m.self_attn.num_heads, m.linear1.out_features,
        dropout=m.dropout.p, activation=activation_name(m.activation), norm_first=m.norm_first,
        layer_norm_eps=m.norm1.eps, bias=m.linear1.bias is not None,
    )
    out.attn = mha_from_torch(m.self_attn)
    out.cross_attn = mha_from_torch(m.multihead_attn)
    copy_linear(out.mlp.linear1, m.linear1.weight, m.linear1.bias)
    copy_linear(out.mlp.linear2, m.linear2.weight, m.linear2.bias)
    for theirs, ours in _NORMS.items():
        copy_norm(getattr(out, ours), getattr(m, theirs))
    return out


def _decoder_layer_to_torch(m: DecoderLayer) -> nn.TransformerDecoderLayer:
    _check_full(m)
    out = nn.TransformerDecoderLayer(
        m.d_model, m.attn.num_heads, m.mlp.linear1.out_features, dropout=m.dropout1.p,
        activation=_torch_activation(m.mlp.activation_name), layer_norm_eps=m.ln1.eps,
        batch_first=True, norm_first=m.norm_first, bias=m.mlp.linear1.bias is not None,
    )
    out.self_attn = mha_to_torch(m.attn)
    out.multihead_attn = mha_to_torch(m.cross_attn)
    copy_linear(out.linear1, m.mlp.linear1.weight, m.mlp.linear1.bias)
    copy_linear(out.linear2, m.mlp.linear2.weight, m.mlp.linear2.bias)
    for theirs, ours in _NORMS.items():
        copy_norm(getattr(out, theirs), getattr(m, ours))
    return out


# ---- TransformerDecoder --------------------------------------------------------------------

def _decoder_from_torch(m: nn.TransformerDecoder) -> Decoder:
    layers = [_decoder_layer_from_torch(layer) for layer in m.layers]
    out = Decoder(layers[0], len(layers),
                  final_norm=False if m.norm is None else _norm_from(m.norm, ours=True))
    out.blocks = nn.ModuleList(layers)
    return out


def _decoder_to_torch(m: Decoder) -> nn.TransformerDecoder:
    layers = [_decoder_layer_to_torch(layer) for layer in m.blocks]
    norm = None if m.ln_final is None else _norm_from(m.ln_final)
    out = nn.TransformerDecoder(layers[0], len(layers), norm=norm)
    out.layers = nn.ModuleList(layers)
    return out


# ---- Transformer ---------------------------------------------------------------------------

@torch.no_grad()
def _transformer_from_torch(m: nn.Transformer) -> Transformer:
    enc_layers = [FROM_TORCH[nn.TransformerEncoderLayer](layer) for layer in m.encoder.layers]
    dec_layers = [_decoder_layer_from_torch(layer) for layer in m.decoder.layers]
    first = dec_layers[0]
    out = Transformer(first.d_model, first.attn.num_heads, 1, 1,
                      first.mlp.linear1.out_features, dropout=first.dropout1.p,
                      activation=first.mlp.activation_name, norm_first=first.norm_first,
                      layer_norm_eps=first.ln1.eps, bias=first.mlp.linear1.bias is not None)
    out.encoder.blocks = nn.ModuleList(enc_layers)
    out.decoder.blocks = nn.ModuleList(dec_layers)
    out.encoder.ln_final = (None if m.encoder.norm is None
                            else _norm_from(m.encoder.norm, ours=True))
    out.decoder.ln_final = (None if m.decoder.norm is None
                            else _norm_from(m.decoder.norm, ours=True))
    return out


@torch.no_grad()
def _transformer_to_torch(m: Transformer) -> nn.Transformer:
    first = m.decoder.blocks[0]
    _check_full(first)
    enc_layers = [TO_TORCH[type(layer)](layer) for layer in m.encoder.blocks]
    dec_layers = [_decoder_layer_to_torch(layer) for layer in m.decoder.blocks]
    out = nn.Transformer(
        m.d_model, m.num_heads, 1, 1, first.mlp.linear1.out_features, first.dropout1.p,
        activation=_torch_activation(first.mlp.activation_name),
        layer_norm_eps=first.ln1.eps, batch_first=True, norm_first=first.norm_first,
        bias=first.mlp.linear1.bias is not None,
    )
    out.encoder.layers = nn.ModuleList(enc_layers)
    out.encoder.num_layers = len(enc_layers)
    out.decoder.layers = nn.ModuleList(dec_layers)
    out.decoder.num_layers = len(dec_layers)
    out.encoder.norm = None if m.encoder.ln_final is None else _norm_from(m.encoder.ln_final)
    out.decoder.norm = None if m.decoder.ln_final is None else _norm_from(m.decoder.ln_final)
    return out


FROM_TORCH[nn.TransformerDecoderLayer] = _decoder_layer_from_torch
FROM_TORCH[nn.TransformerDecoder] = _decoder_from_torch
FROM_TORCH[nn.Transformer] = _transformer_from_torch
TO_TORCH[DecoderLayer] = _decoder_layer_to_torch
TO_TORCH[Decoder] = _decoder_to_torch
TO_TORCH[Transformer] = _transformer_to_torch
