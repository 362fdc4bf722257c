"""The decoding step of a :class:`~handformer.CausalLM` as plain tensor functions.

Shape letters: ``B`` batch, ``H`` heads (``H_kv`` key/value heads, ``G = H / H_kv``), ``D`` head
dim, ``E`` model dim, ``V`` vocabulary, ``L_k`` keys held by a layer's cache.

Why it exists. One decoding step of a small model is little arithmetic (about 7 MFLOP for 4
layers of width 256) and many small calls: through the modules (``CausalLM.run`` ->
``DecoderLayer`` -> ``MultiHeadAttention`` -> ``KVCache.attend``) a step makes about 60
``nn.Module`` calls and a few hundred Python-level operations, each a few microseconds, and
that overhead, not the matrix products, is most of the step's time on a CPU. This module
computes the same numbers, reading each layer's parameters once per ``generate`` call, with
nothing between the tensor operations. Per layer (pre-LN, as GPT-2)::

    h = ln1(x)                              # (B, E); LayerNorm or RMSNorm
    q, k, v = linear(h, [W_q; W_k; W_v])    # viewed as (B, H, 1, D), (B, H_kv, 1, D) x 2:
                                            # one product where the weights are packed
    q, k = q_norm(q), k_norm(k)             # QK-norm only (both at once where they can)
    q, k = rotate(q), rotate(k)             # rotary positions only (the layer's own table)
    K, V, mask = cache.push(k, v)           # (B, H_kv, L_k, D); full: written in place,
                                            # sliding: a ring of the window and the new key
    a = attend(q as (B, H_kv, G, D), K, V)  # grouped, no copy of K/V; soft-capped if asked
    x = x + ln1_post(linear(a, W_o))        # sandwich norms only
    x = x + ln2_post(mlp(ln2(x)))           # plain: W_2 act(W_1 h); gated: W_d (act(g) * u)
                                            # with [g | u] = linear(h, [W_g; W_u])

(post-LN layers put the norm after each residual sum instead); the embedding is scaled
(``embed_scale``) and the logits soft-capped (``final_softcap``) when the config says so.
Every weight is read once per step (a Llama-shaped model streams its weights once, which is
the floor of a memory-bound step). It is what
:func:`~handformer.models.generation.generate` runs for every new token after the prompt
when the model allows it (full and sliding-window attention,
no hooks listening; see :func:`plain_step_refusal`), and it gives the tokens of the module path
(tested to 1e-5 on the logits against a recompute of the whole sequence, and greedy tokens
identical to transformers' GPT-2). The modules stay the reference and the readable path:
the prompt, hooks, weights and every other attention kind go through them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from handformer.attention.cache import DecodingCache, KVCache, WindowKVCache, grouped_step
from handformer.attention.functional import soft_cap
from handformer.attention.kinds import FullAttention
from handformer.attention.local import LocalAttention
from handformer.decoder_layer import DecoderLayer
from handformer.hooks import HookPoint
from handformer.layers import _IN_PLACE, ACTIVATIONS, FeedForward, GatedFeedForward
from handformer.models.quantized import Int8Linear, int8_step_linear
from handformer.models.step_linear import Linear, StepLinears
from handformer.norms import LayerNorm, RMSNorm
from handformer.packing import packed_linear
from handformer.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from handformer.positional_rotary import RotaryEmbedding, rotate_with_tables

__all__ = ["PlainDecodeStep", "plain_step_refusal"]

@dataclass(frozen=True)
class _Norm:
    """A norm's parameters, read once: LayerNorm ``(weight, bias)`` or RMSNorm with its
    offset folded into the weight (``offset + w``, computed once per ``generate`` call)."""

    rms: bool
    weight: Tensor | None
    bias: Tensor | None
    eps: float

    def __call__(self, x: Tensor) -> Tensor:
        if not self.rms:
            return torch.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        # torch.rms_norm's own steps, in as few calls (its CPU kernel makes about 18 for a
        # 576-wide row): x * rsqrt(mean(x^2) + eps) * w, the same bits; half inputs in
        # float32 (as RMSNorm), cast back. The weight broadcasts: one per head for a QK-norm
        # applied to q and k side by side (_head_norms).
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        inv_rms = (xf * xf).mean(-1, keepdim=True).add_(self.eps).rsqrt_()  # (..., 1)
        out = (xf * inv_rms).mul_(self.weight)
        return out if out.dtype == x.dtype else out.to(x.dtype)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters and cache, read once (None: no bias / no such norm)."""

    norm_first: bool
    ln1: _Norm
    ln2: _Norm
    post_attn: _Norm | None
    post_mlp: _Norm | None
    # x -> F.linear(x, W, b), by the kernel step_linear picks for W's dtype
    q: Linear | None  # (H * D, E); None where qkv is there
    k: Linear | None  # (H_kv * D, E)
    v: Linear | None
    qkv: Linear | None  # ((H + 2 H_kv) * D, E): q, k, v stored back to back (or None)
    out: Linear  # (E, H * D)
    q_norm: _Norm | None  # (D,); None where qk_norm is there
    k_norm: _Norm | None
    qk_norm: _Norm | None  # both at once, weight (H + H_kv, 1, D) (RMSNorms of one eps)
    gated: bool
    ff1: Linear | None  # plain: linear1 (d_ff, E); gated: gate_proj (None where gate_up is)
    ff2: Linear  # plain: linear2 (E, d_ff); gated: down_proj
    up: Linear | None  # gated: up_proj (d_ff, E)
    gate_up: Linear | None  # gated: (2 d_ff, E), gate and up stored back to back (or None)
    activation: Callable[[Tensor], Tensor]  # overwrites its input where it is a stock one
    rotary: RotaryEmbedding | None
    scale: float | None
    softcap: float | None
    cache: KVCache | WindowKVCache


def plain_step_refusal(model: nn.Module, cache: DecodingCache | None) -> str | None:
    """Why the plain step cannot stand in for the modules of ``model``, a
    :class:`~handformer.CausalLM` (None: it can).

    It covers a CausalLM whose layers use full attention (plain
    :class:`~handformer.attention.cache.KVCache` caches) or sliding-window attention (its
    :class:`~handformer.attention.cache.WindowKVCache`), with LayerNorm or RMSNorm, a plain
    or gated MLP, in eval mode (dropout off), with no PyTorch forward hooks anywhere: those
    would not run, since the modules are not called. Handformer's own hook points are
    checked at every step (``generate`` asks ``hooks_active()`` before each step).
    """
    if model.training:
        return "the model is in training mode"
    if cache is None or len(cache) != len(model.blocks):
        return "no decoding cache of this model"
    for i, (layer, layer_cache) in enumerate(zip(model.blocks, cache.layers, strict=True)):
        if type(layer) is not DecoderLayer or layer.cross_attn is not None:
            return f"layer {i} is not a DecoderLayer without cross-attention"
        kind = type(layer.attn.attention)
        if kind not in (FullAttention, LocalAttention):
            return f"layer {i} uses {kind.__name__}"
        wanted = KVCache if kind is FullAttention else WindowKVCache
        if type(layer_cache) is not wanted or not layer_cache.seen:
            return (f"layer {i}'s cache is a {type(layer_cache).__name__}, not a filled "
                    f"{wanted.__name__}")
        rotary = layer.attn.rotary
        if rotary is not None and type(rotary) is not RotaryEmbedding:
            return f"layer {i} has a rotary module of type {type(rotary).__name__}"
        norms = [layer.ln1, layer.ln2, layer.ln1_post, layer.ln2_post,
                 layer.attn.q_norm, layer.attn.k_norm]
        if any(n is not None and type(n) not in (LayerNorm, RMSNorm, nn.LayerNorm)
               for n in norms):
            return f"layer {i} has a norm of another type"
        if type(layer.mlp) not in (FeedForward, GatedFeedForward):
            return f"layer {i}'s MLP is a {type(layer.mlp).__name__}"
    final = model.ln_final
    if final is not None and type(final) not in (LayerNorm, RMSNorm, nn.LayerNorm):
        return "the final norm is of another type"
    if (getattr(torch_module, "_global_forward_hooks", None)
            or getattr(torch_module, "_global_forward_pre_hooks", None)):
        return "global PyTorch module hooks are registered"
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"PyTorch forward hooks are registered on {name or 'the model'}"
        if isinstance(module, HookPoint) and type(module) is not HookPoint:
            return f"{name} is a {type(module).__name__} (it computes something: a splice)"
    return None


def _linear(make: StepLinears, module: nn.Linear) -> Linear:
    if isinstance(module, Int8Linear):  # its own int8 (or int4) product (models.quantized)
        return int8_step_linear(module, scratch=make.int8_scratch)
    return make(module.weight, module.bias)


def _packed(make: StepLinears, *modules: nn.Linear) -> Linear | None:
    if any(isinstance(m, Int8Linear) for m in modules):  # int8: the input prepared once
        if all(isinstance(m, Int8Linear) for m in modules) and \
                len({m.in_features for m in modules}) == 1:
            return int8_step_linear(*modules, scratch=make.int8_scratch)
        return None
    packed = packed_linear(*modules)
    return None if packed is None else make(*packed)


def _norm(module: nn.Module | None) -> _Norm | None:
    if module is None:
        return None
    if isinstance(module, RMSNorm):
        weight = module.weight + module.offset if module.offset else module.weight
        return _Norm(True, weight, None, module.eps)
    return _Norm(False, module.weight, module.bias, module.eps)


# Overwriting the step's fresh (1, 1, d_ff) tensor saves a copy for relu and silu; torch has no
# public in-place GELU, and torch.ops.aten.gelu_ costs more in Python dispatch than the copy.
_STEP_IN_PLACE = ("relu", "silu")


def _head_norms(q_norm: nn.Module | None, k_norm: nn.Module | None, heads: int,
                kv_heads: int) -> _Norm | None:
    """The layer's q and k norms as one RMSNorm over ``qk: (B, H + H_kv, 1, D)``, q's weight
    on the first ``H`` heads and k's on the others (None: no QK-norm, or one that is not two
    RMSNorms of the same eps). The norm's five operations once instead of twice, and no
    ``cat``: 0.5 ms a Gemma 3 step."""
    q, k = _norm(q_norm), _norm(k_norm)
    if q is None or k is None or not (q.rms and k.rms) or q.eps != k.eps:
        return None
    D = q.weight.shape[-1]
    weight = torch.cat([q.weight.expand(heads, D), k.weight.expand(kv_heads, D)])
    return _Norm(True, weight[:, None, :], None, q.eps)  # (H + H_kv, D) -> (H + H_kv, 1, D)


def _activation(ff: FeedForward | GatedFeedForward) -> Callable[[Tensor], Tensor]:
    """The MLP's activation, overwriting its input where that is cheaper (see
    ``_STEP_IN_PLACE``) unless the module's activation was replaced."""
    stock = ff.activation is ACTIVATIONS.get(ff.activation_name)
    return _IN_PLACE[ff.activation_name] if stock and ff.activation_name in _STEP_IN_PLACE \
        else ff.activation


def _layer(layer: DecoderLayer, layer_cache: KVCache | WindowKVCache,
           make: StepLinears) -> _Layer:
    attn, ff = layer.attn, layer.mlp
    gated = isinstance(ff, GatedFeedForward)
    qkv = _packed(make, attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up = _packed(make, ff.gate_proj, ff.up_proj) if gated else None
    q, k, v = (None, None, None) if qkv is not None else (
        _linear(make, attn.q_proj), _linear(make, attn.k_proj), _linear(make, attn.v_proj))
    qk_norm = _head_norms(attn.q_norm, attn.k_norm, attn.num_heads, attn.num_kv_heads)
    separate = qk_norm is None
    return _Layer(
        norm_first=layer.norm_first, ln1=_norm(layer.ln1), ln2=_norm(layer.ln2),
        post_attn=_norm(layer.ln1_post), post_mlp=_norm(layer.ln2_post),
        q=q, k=k, v=v, qkv=qkv, out=_linear(make, attn.out_proj),
        q_norm=_norm(attn.q_norm) if separate else None,
        k_norm=_norm(attn.k_norm) if separate else None, qk_norm=qk_norm,
        gated=gated,
        ff1=None if gate_up is not None else _linear(make, ff.gate_proj if gated else ff.linear1),
        ff2=_linear(make, ff.down_proj if gated else ff.linear2),
        up=_linear(make, ff.up_proj) if gated and gate_up is None else None,
        gate_up=gate_up,
        activation=_activation(ff), rotary=attn.rotary, scale=attn.scale,
        softcap=attn.attention.softcap, cache=layer_cache)


def _capped_step(q: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None,
                 scale: float | None, softcap: float) -> Tensor:
    """One new query per sequence over held keys with soft-capped scores, grouped.

    ``q: (B, H, 1, D)``, ``keys``/``values`` ``(B, H_kv, L_k, D)``; the explicit
    ``softmax(cap(q k^T * scale)) v`` of the module path, in float32 for half inputs.
    """
    B, H, _, D = q.shape
    H_kv = keys.shape[1]
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    grouped = q.reshape(B, H_kv, H // H_kv, D).to(compute)  # (B, H_kv, G, D)
    scale = D ** -0.5 if scale is None else scale
    scores = soft_cap(torch.matmul(grouped, keys.to(compute).transpose(-2, -1)) * scale,
                      softcap)  # (B, H_kv, G, L_k)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values.to(compute))  # (B, H_kv, G, D)
    return out.to(q.dtype).reshape(B, H, 1, D)


class PlainDecodeStep:
    """``step(token) -> logits``: one decoding step of a CausalLM, as plain functions.

    Build it with :meth:`build` after the prompt went through ``model(..., cache=cache)``;
    each call feeds one new token per sequence, writes its keys and values into ``cache``
    and advances the cache's counters, exactly as ``model.decode_step`` does. Inputs are
    trusted (``generate`` checked them); call it under ``torch.inference_mode()``.
    """

    def __init__(self, model: nn.Module, cache: DecodingCache) -> None:
        config = model.config
        self.cache = cache
        self.num_heads, self.num_kv_heads = config.num_heads, model.blocks[0].attn.num_kv_heads
        # ids -> (B, E): the (V, E) table's rows, or an int8 model's embedding (its rows
        # dequantized, or read from the file, as they are gathered)
        embedding = model.tok_emb
        plain = isinstance(embedding, nn.Embedding)
        self.lookup = (functools.partial(F.embedding, weight=embedding.weight) if plain
                       else embedding.forward)
        dtype = embedding.weight.dtype if plain else torch.float32
        self.embed_scale = (None if config.embed_scale is None else
                            torch.tensor(config.embed_scale, dtype=dtype))
        self.final_softcap = config.final_softcap
        self.pos_table = None  # (max_len, E): learned or sinusoidal positions
        if isinstance(model.pos_emb, LearnedPositionalEmbedding):
            self.pos_table = model.pos_emb.weight
        elif isinstance(model.pos_emb, SinusoidalPositionalEncoding):
            self.pos_table = model.pos_emb.pe.to(dtype)
        self.final_norm = _norm(model.ln_final)
        make = StepLinears(model)  # the bf16 kernel where it pays (see step_linear)
        self.lm_head = _linear(make, model.lm_head)  # (B, E) -> (B, V)
        self.layers = [_layer(layer, layer_cache, make)
                       for layer, layer_cache in zip(model.blocks, cache.layers, strict=True)]
        # the distinct rotary tables (Gemma 3: one for local layers, one for global ones)
        self.rotaries = list({id(la.rotary): la.rotary for la in self.layers
                              if la.rotary is not None}.values())

    @classmethod
    def build(cls, model: nn.Module, cache: DecodingCache) -> PlainDecodeStep | None:
        """The plain step for ``model`` (a CausalLM) and its filled ``cache``, or None where
        it does not apply (see :func:`plain_step_refusal`)."""
        return None if plain_step_refusal(model, cache) is not None else cls(model, cache)

    def __call__(self, token: Tensor) -> Tensor:
        """Feed ``token: (B,)``, one new real token per sequence; return ``(B, V)`` logits."""
        B = token.shape[0]
        positions = self.cache.next_positions  # (B,)
        x = self.lookup(token)  # (B, E)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.pos_table is not None:
            x = x + F.embedding(positions, self.pos_table)  # (B, E)
        tables = {}  # rotary module -> its (cos, sin) tables, (B, 1, 1, D) each, once per step
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        for rotary in self.rotaries:
            tables[id(rotary)] = rotary.tables(positions[:, None], compute, x.device)
        H = self.num_heads
        for layer in self.layers:
            h = layer.ln1(x) if layer.norm_first else x
            qk, v = self._qk_v(layer, h)  # (B, H + H_kv, 1, D), (B, H_kv, 1, D)
            if layer.qk_norm is not None:
                qk = layer.qk_norm(qk)
            elif layer.q_norm is not None:
                qk = torch.cat([layer.q_norm(qk[:, :H]), layer.k_norm(qk[:, H:])], dim=1)
            if layer.rotary is not None:  # q and k turned together: one rotation, not two
                qk = rotate_with_tables(qk, *tables[id(layer.rotary)])
            q, k = qk[:, :H], qk[:, H:]  # (B, H, 1, D), (B, H_kv, 1, D)
            keys, values, key_mask = layer.cache.push(k, v)  # (B, H_kv, L_k, D) each
            if layer.softcap is None:
                z = grouped_step(q, keys, values, key_mask, layer.scale)  # (B, H, 1, D)
            else:
                z = _capped_step(q, keys, values, key_mask, layer.scale, layer.softcap)
            attn = layer.out(z.view(B, -1))  # (B, H, 1, D) -> (B, E)
            if layer.post_attn is not None:
                attn = layer.post_attn(attn)
            if layer.norm_first:
                x = x + attn
                x = x + self._mlp(layer, layer.ln2(x))
            else:
                x = layer.ln1(x + attn)
                x = layer.ln2(x + self._mlp(layer, x))
        if self.final_norm is not None:
            x = self.final_norm(x)
        self.cache.seen += 1
        self.cache.next_positions = positions + 1
        return soft_cap(self.lm_head(x), self.final_softcap)  # (B, V)

    def _qk_v(self, layer: _Layer, h: Tensor) -> tuple[Tensor, Tensor]:
        """The queries and keys of ``h: (B, E)`` side by side, ``(B, H + H_kv, 1, D)``, and
        the values, ``(B, H_kv, 1, D)``: one product where the weights are packed."""
        B, H, H_kv = h.shape[0], self.num_heads, self.num_kv_heads
        if layer.qkv is not None:
            qkv = layer.qkv(h).view(B, H + 2 * H_kv, 1, -1)  # (B, H + 2 H_kv, 1, D)
            return qkv[:, :H + H_kv], qkv[:, H + H_kv:]
        q = layer.q(h).view(B, H, 1, -1)  # (B, H, 1, D)
        k = layer.k(h).view(B, H_kv, 1, -1)  # (B, H_kv, 1, D)
        v = layer.v(h).view(B, H_kv, 1, -1)
        return torch.cat([q, k], dim=1), v

    @staticmethod
    def _mlp(layer: _Layer, h: Tensor) -> Tensor:
        """The layer's MLP on ``h: (B, E)``, with its sandwich norm."""
        if layer.gate_up is not None:  # one product: [gate | up], (B, 2 d_ff)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)  # (B, d_ff) each
            hidden = layer.activation(gate).mul_(up)
        elif layer.gated:
            hidden = layer.activation(layer.ff1(h)).mul_(layer.up(h))
        else:
            hidden = layer.activation(layer.ff1(h))  # (B, d_ff)
        out = layer.ff2(hidden)  # (B, E)
        return out if layer.post_mlp is None else layer.post_mlp(out)
