"""The decoding step of a :class:`~handformer.CausalLM` as plain tensor functions.

Shape letters: ``B`` batch, ``H`` heads, ``D`` head dim, ``E`` model dim, ``V`` vocabulary,
``L_k`` keys held by a layer's cache.

Why it exists. One decoding step of a small model is little arithmetic (about 7 MFLOP for 4
layers of width 256) and many small calls: through the modules (``CausalLM.run`` ->
``DecoderLayer`` -> ``MultiHeadAttention`` -> ``KVCache.attend``) a step makes about 60
``nn.Module`` calls and a few hundred Python-level operations, each a few microseconds, and
that overhead, not the matrix products, is most of the step's time on a CPU. This module
computes the same numbers, reading each layer's parameters once per ``generate`` call, with
nothing between the tensor operations. Per layer (pre-LN, as GPT-2)::

    h = layer_norm(x)                       # (B, E)
    q, k, v = linear(h, W_q), ..., ...      # (B, E) each, viewed as (B, H, 1, D)
    q, k = rotate(q), rotate(k)             # rotary positions only
    K, V, mask = cache.push(k, v)           # written in place: (B, H, L_k, D)
    x = x + linear(sdpa(q, K, V, mask), W_o)
    x = x + linear(act(linear(layer_norm(x), W_1)), W_2)

(post-LN layers put the norm after each residual sum instead). It is what
:func:`~handformer.models.generation.generate` runs for every new token after the prompt
when the model allows it (full attention, no hooks
listening; see :func:`plain_step_refusal`), and it gives the tokens of the module path
(tested to 1e-5 on the logits against a recompute of the whole sequence, and greedy tokens
identical to transformers' GPT-2). The modules stay the reference and the readable path:
the prompt, hooks, weights and every other attention kind go through them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from handformer.attention.cache import DecodingCache, KVCache
from handformer.attention.kinds import FullAttention
from handformer.decoder_layer import DecoderLayer
from handformer.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from handformer.positional_rotary import RotaryEmbedding

__all__ = ["PlainDecodeStep", "plain_step_refusal"]


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters and cache, read once (None: no bias)."""

    norm_first: bool
    eps: float
    norm1: tuple[Tensor | None, Tensor | None]  # LayerNorm weight, bias: (E,)
    norm3: tuple[Tensor | None, Tensor | None]
    q: tuple[Tensor, Tensor | None]  # Linear weight (E, E), bias (E,)
    k: tuple[Tensor, Tensor | None]
    v: tuple[Tensor, Tensor | None]
    out: tuple[Tensor, Tensor | None]
    ff1: tuple[Tensor, Tensor | None]  # (d_ff, E), (d_ff,)
    ff2: tuple[Tensor, Tensor | None]  # (E, d_ff), (E,)
    activation: Callable[[Tensor], Tensor]
    cache: KVCache


def plain_step_refusal(model: nn.Module, cache: DecodingCache | None) -> str | None:
    """Why the plain step cannot stand in for the modules of ``model``, a
    :class:`~handformer.CausalLM` (None: it can).

    It covers a CausalLM whose layers use full attention with the
    default scale and plain :class:`~handformer.attention.cache.KVCache` caches, in eval mode
    (dropout off), with no PyTorch forward hooks anywhere: those would not run, since the
    modules are not called. Handformer's own hook points are checked at every step
    (``generate`` asks ``hooks_active()`` before each step).
    """
    if model.training:
        return "the model is in training mode"
    if cache is None or len(cache) != len(model.layers):
        return "no decoding cache of this model"
    for i, (layer, layer_cache) in enumerate(zip(model.layers, cache.layers, strict=True)):
        if type(layer) is not DecoderLayer or layer.cross_attn is not None:
            return f"layer {i} is not a DecoderLayer without cross-attention"
        if type(layer.self_attn.attention) is not FullAttention:
            return f"layer {i} uses {type(layer.self_attn.attention).__name__}"
        if type(layer_cache) is not KVCache or layer_cache.keys_values()[0] is None:
            return f"layer {i}'s cache is a {type(layer_cache).__name__}, not a filled KVCache"
        rotary = layer.self_attn.rotary
        if rotary is not None and (type(rotary) is not RotaryEmbedding
                                   or rotary is not model.layers[0].self_attn.rotary):
            return f"layer {i} has its own rotary module"
    if (getattr(torch_module, "_global_forward_hooks", None)
            or getattr(torch_module, "_global_forward_pre_hooks", None)):
        return "global PyTorch module hooks are registered"
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"PyTorch forward hooks are registered on {name or 'the model'}"
    return None


def _linear(module: nn.Linear) -> tuple[Tensor, Tensor | None]:
    return module.weight, module.bias


def _norm(module: nn.LayerNorm) -> tuple[Tensor | None, Tensor | None]:
    return module.weight, module.bias


class PlainDecodeStep:
    """``step(token) -> logits``: one decoding step of a CausalLM, as plain functions.

    Build it with :meth:`build` after the prompt went through ``model(..., cache=cache)``;
    each call feeds one new token per sequence, writes its keys and values into ``cache``
    and advances the cache's counters, exactly as ``model.decode_step`` does. Inputs are
    trusted (``generate`` checked them); call it under ``torch.inference_mode()``.
    """

    def __init__(self, model: nn.Module, cache: DecodingCache) -> None:
        self.cache = cache
        self.d_model = model.config.d_model
        self.num_heads = model.config.num_heads
        self.tok_emb = model.tok_emb.weight  # (V, E)
        self.pos_table = None  # (max_len, E): learned or sinusoidal positions
        if isinstance(model.pos_emb, LearnedPositionalEmbedding):
            self.pos_table = model.pos_emb.weight
        elif isinstance(model.pos_emb, SinusoidalPositionalEncoding):
            self.pos_table = model.pos_emb.pe.to(self.tok_emb.dtype)
        self.rotary = model.layers[0].self_attn.rotary
        self.final_norm = None if model.norm is None else (_norm(model.norm), model.norm.eps)
        self.lm_head = model.lm_head.weight  # (V, E)
        self.layers = [
            _Layer(norm_first=layer.norm_first, eps=layer.norm1.eps,
                   norm1=_norm(layer.norm1), norm3=_norm(layer.norm3),
                   q=_linear(layer.self_attn.q_proj), k=_linear(layer.self_attn.k_proj),
                   v=_linear(layer.self_attn.v_proj), out=_linear(layer.self_attn.out_proj),
                   ff1=_linear(layer.ff.linear1), ff2=_linear(layer.ff.linear2),
                   activation=layer.ff.activation, cache=layer_cache)
            for layer, layer_cache in zip(model.layers, cache.layers, strict=True)
        ]

    @classmethod
    def build(cls, model: nn.Module, cache: DecodingCache) -> PlainDecodeStep | None:
        """The plain step for ``model`` (a CausalLM) and its filled ``cache``, or None where
        it does not apply (see :func:`plain_step_refusal`)."""
        return None if plain_step_refusal(model, cache) is not None else cls(model, cache)

    def __call__(self, token: Tensor) -> Tensor:
        """Feed ``token: (B,)``, one new real token per sequence; return ``(B, V)`` logits."""
        B, E, H = token.shape[0], self.d_model, self.num_heads
        positions = self.cache.next_positions  # (B,)
        x = F.embedding(token, self.tok_emb)  # (B, E)
        if self.pos_table is not None:
            x = x + F.embedding(positions, self.pos_table)  # (B, E)
        cos_sin = None
        if self.rotary is not None:  # one table for every layer: (B, 1, 1, D/2) each
            compute = torch.float64 if x.dtype == torch.float64 else torch.float32
            cos_sin = self.rotary.cos_sin(positions[:, None], compute, x.device)
        for layer in self.layers:
            h = torch.layer_norm(x, (E,), *layer.norm1, layer.eps) if layer.norm_first else x
            q = F.linear(h, *layer.q).view(B, H, 1, -1)  # (B, E) -> (B, H, 1, D)
            k = F.linear(h, *layer.k).view(B, H, 1, -1)
            v = F.linear(h, *layer.v).view(B, H, 1, -1)
            if cos_sin is not None:
                q, k = self.rotary.rotate_with(q, *cos_sin), self.rotary.rotate_with(k, *cos_sin)
            keys, values, key_mask = layer.cache.push(k, v)  # (B, H, L_k, D) each
            z = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask)
            attn = F.linear(z.view(B, E), *layer.out)  # (B, H, 1, D) -> (B, E)
            if layer.norm_first:
                x = x + attn
                h = torch.layer_norm(x, (E,), *layer.norm3, layer.eps)
                x = x + F.linear(layer.activation(F.linear(h, *layer.ff1)), *layer.ff2)
            else:
                x = torch.layer_norm(x + attn, (E,), *layer.norm1, layer.eps)
                ff = F.linear(layer.activation(F.linear(x, *layer.ff1)), *layer.ff2)
                x = torch.layer_norm(x + ff, (E,), *layer.norm3, layer.eps)
        if self.final_norm is not None:
            (weight, bias), eps = self.final_norm
            x = torch.layer_norm(x, (E,), weight, bias, eps)
        self.cache.seen += 1
        self.cache.next_positions = positions + 1
        return F.linear(x, self.lm_head)  # (B, V)

