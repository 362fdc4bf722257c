"""Linear (kernel) attention: non-causal, causal in chunks, and a recurrent step.

Pattern and formula (positions aligned bottom-right: query ``i`` sits at key position
``p = i + L_k - L_q``)::

    out_i = sum_j phi(q_i) . phi(k_j) v_j / (sum_j phi(q_i) . phi(k_j) + eps)

over the allowed keys ``j``: all of them, or ``j <= p`` when ``causal``, minus the keys a key
mask removes. ``phi(x) = elu(x) + 1`` by default (positive, so the denominator is positive),
``"relu"``, or any callable. No softmax and no ``1/sqrt(D)`` scale: the kernel replaces them.

Complexity: because ``phi(q_i) . phi(k_j)`` factorises, the keys are summarised once into the
state ``S = sum_j phi(k_j) v_j^T`` ``(D, D_v)`` and ``z = sum_j phi(k_j)`` ``(D,)``:

* non-causal: ``O((L_q + L_k) * D * D_v)`` time, ``O(D * D_v)`` extra memory;
* causal: in chunks of :data:`CHUNK` positions, quadratic inside a chunk and a running state
  between chunks: ``O(L * CHUNK * D + L * D * D_v)`` time. Chunks are processed a group at a
  time so the intermediate tensors stay small;
* :func:`linear_attention_step`: the recurrent form for decoding, ``O(D * D_v)`` per token
  with a constant-size :class:`LinearAttentionState`.

States and sums are accumulated in float32 (float64 for float64 inputs), whatever the input
dtype. The state can only drop *keys*, so ``mask`` must be a key mask broadcastable to
``(..., 1, L_k)``: a boolean one removes keys, a floating one is a bias ``b_j`` that weights
each key's kernel as an additive bias weights softmax scores. Like softmax, a float bias is
shift-invariant: query ``i`` weights key ``j`` by ``exp(b_j - m_i)``, ``m_i`` the largest bias
among the keys it sees, so the largest weight is 1, any finite bias (``1e4`` included) is safe,
and ``-inf`` removes a key. (Plain ``exp(b_j)`` overflows above ~88 in float32 and gives NaN.
Dividing the numerator and the denominator by ``exp(m_i)`` leaves their ratio unchanged, so
the two forms differ only in the relative size of ``eps``.) Causal attention keeps the
running maximum with its state, rescaling the sums when it grows, as blocked softmax does. A
per-query mask raises ``ValueError``.

``scale`` multiplies ``q`` before the feature map: ``phi(scale * q)``. Softmax attention
computes ``exp(scale * q . k)``; this kernel stands in for ``exp(q . k)``, so the analogue of
the softmax scale is a factor on ``q`` inside ``phi``. Its default (None) means 1, the kernel of
Katharopoulos et al. (2020), which has no scale (and what this module computed before it took
one), not softmax's ``1 / sqrt(D)``; pass ``scale=1 / math.sqrt(D)`` for a softmax-like
temperature.

How it differs from the seed's ``linear_attention`` (section 7 of the tutorial): the seed uses
``q`` and ``k`` themselves as features (no positive feature map), so ``q_i . sum_j k_j`` -- its
denominator -- is often negative or near zero, and its "weights" are not a distribution (the
output can blow up or flip sign). It has no causal form and no masks, and assumes a
``(B, L, H, D)`` layout, unlike the rest of the tutorial.

Shape letters: ``L_q`` queries, ``L_k`` keys, ``T`` new tokens of a step, ``D`` head dim,
``D_v`` value dim, ``n_c`` chunks, ``C`` chunk length; leading batch dims ``...``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.attention.functional import check_qkv
from handformer.attention.kinds import AttentionKind, check_no_dropout
from handformer.checks import check_scale
from handformer.masks import causal_mask, check_mask

__all__ = ["linear_attention", "linear_attention_step", "LinearAttentionState",
           "LinearAttention", "feature_map_fn"]

FeatureMap = str | Callable[[Tensor], Tensor]
CHUNK = 128  # positions per causal chunk
_GROUP = 8  # chunks processed together (each group is a few MB)


def _elu_plus_one(x: Tensor) -> Tensor:
    return F.elu(x).add_(1.0)  # in place: elu saves its input, not its output, for backward


def feature_map_fn(feature_map: FeatureMap) -> Callable[[Tensor], Tensor]:
    """The function ``phi`` for ``"elu"`` (``elu(x) + 1``), ``"relu"`` or a callable.

    Raises:
        ValueError: for an unknown name.
        TypeError: for something neither a string nor callable.
    """
    if isinstance(feature_map, str):
        if feature_map == "elu":
            return _elu_plus_one
        if feature_map == "relu":
            return F.relu
        raise ValueError(f"feature_map must be 'elu', 'relu' or a callable, got {feature_map!r}")
    if callable(feature_map):
        return feature_map
    raise TypeError(
        f"feature_map must be 'elu', 'relu' or a callable, got {type(feature_map).__name__}"
    )


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number (it keeps empty rows at 0), got {eps!r}")
    return float(eps)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_mask(mask: Tensor | None, score_shape: tuple[int, ...], dtype: torch.dtype
              ) -> tuple[Tensor | None, Tensor | None]:
    """Check a key mask; return ``(keep, bias)``, each ``(..., L_k, 1)`` or None.

    A bool mask gives 0/1 multipliers ``keep``; a float mask gives the key biases ``bias``
    (in ``dtype``, ``-inf`` = removed).
    """
    if mask is None:
        return None, None
    check_mask(mask, score_shape)
    if mask.dim() >= 2 and mask.shape[-2] != 1:
        raise ValueError(
            f"linear attention takes only key masks broadcastable to (..., 1, L_k), got mask "
            f"of shape {tuple(mask.shape)} for scores {score_shape}: it sums all allowed keys "
            "into one state shared by every query, so it cannot give queries different key "
            "sets. Use causal=True for causal masking, or a softmax kind for other patterns."
        )
    if mask.dim() < 2:
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))  # (..., 1, L_k)
    mask = mask.transpose(-2, -1)  # (..., L_k, 1)
    if mask.dtype == torch.bool:
        return mask.to(dtype), None
    return None, mask.to(dtype)


def _finite(x: Tensor) -> Tensor:
    """``x`` with ``-inf`` replaced by 0: a safe reference to subtract (``exp(-inf - 0) = 0``)."""
    return x.masked_fill(torch.isneginf(x), 0.0)


@dataclass
class LinearAttentionState:
    """Running sums of causal linear attention over the keys seen so far.

    Attributes:
        kv: ``S = sum_j w_j phi(k_j) v_j^T``, ``(..., D, D_v)``, float32 (float64 for float64).
        k_sum: ``z = sum_j w_j phi(k_j)``, ``(..., D)``, same dtype.
        bias_max: ``m``, the largest float key bias so far, ``(..., 1, 1)`` (``-inf`` before
            any allowed key), with key weights ``w_j = exp(b_j - m)``; None when no float bias
            was ever given (then ``w_j`` is 1 for allowed keys, 0 for removed ones).
    """

    kv: Tensor
    k_sum: Tensor
    bias_max: Tensor | None = None


def _causal(fq: Tensor, fk: Tensor, v: Tensor, state: LinearAttentionState | None
            ) -> tuple[Tensor, Tensor, LinearAttentionState]:
    """Causal kernel sums for aligned queries/keys (query ``t`` sees keys ``<= t``).

    Args:
        fq: ``phi(q)`` ``(..., n, D)``; fk: ``phi(k)`` ``(..., n, D)``; v: ``(..., n, D_v)``,
            all in the accumulation dtype.
        state: sums over earlier keys, seen by every query (None = empty).

    Returns:
        ``(num, den, state)``: ``num`` ``(..., n, D_v)``, ``den`` ``(..., n, 1)`` and the state
        after the last key.
    """
    n, D, D_v = fq.shape[-2], fq.shape[-1], v.shape[-1]
    batch = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2])
    if state is None:
        Sz = fq.new_zeros(*batch, D, D_v + 1)  # (..., D, D_v + 1)
    else:
        Sz = torch.cat([state.kv, state.k_sum.unsqueeze(-1)], dim=-1)  # (..., D, D_v + 1)
    C = CHUNK
    n_c = math.ceil(n / C)
    pad = n_c * C - n

    def chunked(x: Tensor) -> Tensor:  # a view when no padding is needed
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return x.unflatten(-2, (n_c, C))  # (..., n_c, C, *)

    fqc, fkc, vc = chunked(fq), chunked(fk), chunked(v)  # (..., n_c, C, D | D_v)
    ones = torch.ones_like(vc[..., :1])  # (..., n_c, C, 1)
    if pad:
        ones[..., -1, C - pad:, :] = 0.0  # padded positions are not keys
    outs = []
    # Groups of chunks are sliced out of the natural layout: each group (a few MB) is copied
    # where matmul needs it, while it is in cache, instead of copying whole tensors up front.
    for g0 in range(0, n_c, _GROUP):
        g = slice(g0, g0 + _GROUP)
        qg, kg = fqc[..., g, :, :], fkc[..., g, :, :]  # (..., G, C, D)
        # A column of ones after the values makes every matmul yield the denominator too:
        # phi(k)^T [v | 1] = [S | z] and phi(q) [S | z] = [numerator | denominator].
        vg = torch.cat([vc[..., g, :, :], ones[..., g, :, :]], dim=-1)  # (..., G, C, D_v + 1)
        kv = torch.matmul(kg.transpose(-2, -1), vg)  # (..., G, D, D_v + 1)
        # state before each chunk of the group: Sz plus the sums of the earlier chunks
        before = torch.cat([Sz.unsqueeze(-3), kv[..., :-1, :, :]], dim=-3).cumsum(dim=-3)
        scores = torch.matmul(qg, kg.transpose(-2, -1)).tril_()  # (..., G, C, C)
        out = torch.matmul(scores, vg)
        out += torch.matmul(qg, before)  # (..., G, C, D_v + 1)
        outs.append(out)
        Sz = before[..., -1, :, :] + kv[..., -1, :, :]
    out = torch.cat(outs, dim=-3).flatten(-3, -2)[..., :n, :]  # (..., n, D_v + 1)
    num, den = out[..., :D_v], out[..., D_v:]  # (..., n, D_v), (..., n, 1)
    S, z = Sz[..., :D_v], Sz[..., D_v]  # (..., D, D_v), (..., D)
    return num, den, LinearAttentionState(kv=S, k_sum=z)


def _causal_biased(fq: Tensor, fk: Tensor, v: Tensor, bias: Tensor,
                   state: LinearAttentionState | None
                   ) -> tuple[Tensor, Tensor, LinearAttentionState]:
    """:func:`_causal` with float key biases, stabilised by the running maximum.

    Query ``t`` weights key ``j <= t`` by ``exp(b_j - M_t)``, ``M_t`` the largest bias among
    the keys it sees (the state's included), so no weight exceeds 1. Chunk by chunk: inside a
    chunk the ``(C, C)`` weights are exact per query; the state carries its sums relative to
    its own maximum ``m`` and is rescaled by ``exp(m - M_t) <= 1`` for each query, and by
    ``exp(m - m') <= 1`` when a chunk raises the maximum to ``m'``.

    Args:
        fq, fk, v: as in :func:`_causal`.
        bias: ``(..., n, 1)`` key biases (finite or ``-inf``), in the accumulation dtype.
        state: sums over earlier keys (None = empty).

    Returns:
        ``(num, den, state)`` as in :func:`_causal`, with each query's sums relative to its
        own ``M_t`` (so ``num / (den + eps)`` is the stabilised output).
    """
    n, D, D_v = fq.shape[-2], fq.shape[-1], v.shape[-1]
    batch = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2], bias.shape[:-2])
    if state is None:
        Sz = fq.new_zeros(*batch, D, D_v + 1)  # (..., D, D_v + 1)
        ref = bias.new_full((*bias.shape[:-2], 1, 1), float("-inf"))  # (..., 1, 1)
    else:
        Sz = torch.cat([state.kv, state.k_sum.unsqueeze(-1)], dim=-1)  # (..., D, D_v + 1)
        ref = _state_bias_max(state).to(bias.dtype)  # (..., 1, 1)
    top = torch.maximum(bias.cummax(dim=-2).values, ref)  # (..., n, 1): M_t for every query
    outs = []
    for c0 in range(0, n, CHUNK):
        c1 = min(c0 + CHUNK, n)
        m = c1 - c0
        qc, kc = fq[..., c0:c1, :], fk[..., c0:c1, :]  # (..., m, D)
        vc = torch.cat([v[..., c0:c1, :], v.new_ones(*v.shape[:-2], m, 1)], dim=-1)
        # vc: (..., m, D_v + 1), the ones column yields the denominator (see _causal)
        b, M = bias[..., c0:c1, :], _finite(top[..., c0:c1, :])  # (..., m, 1) each
        later = ~causal_mask(m, m, device=fq.device)  # (m, m), True for j > t
        w = torch.exp((b.transpose(-2, -1) - M).masked_fill(later, float("-inf")))
        # w: (..., m, m) = exp(b_j - M_t) for j <= t, 0 above the diagonal (no inf there)
        scores = torch.matmul(qc, kc.transpose(-2, -1)) * w  # (..., m, m)
        out = torch.matmul(scores, vc)
        out += torch.matmul(qc, Sz) * torch.exp(ref - M)  # (..., m, D_v + 1)
        outs.append(out)
        new_ref = top[..., c1 - 1:c1, :]  # (..., 1, 1), the maximum after this chunk
        base = _finite(new_ref)
        kw = kc * torch.exp(b - base)  # (..., m, D), each key relative to the new maximum
        Sz = Sz * torch.exp(ref - base) + torch.matmul(kw.transpose(-2, -1), vc)
        ref = new_ref
    out = torch.cat(outs, dim=-2)  # (..., n, D_v + 1)
    num, den = out[..., :D_v], out[..., D_v:]  # (..., n, D_v), (..., n, 1)
    return num, den, LinearAttentionState(kv=Sz[..., :D_v], k_sum=Sz[..., D_v], bias_max=ref)


def _state_bias_max(state: LinearAttentionState) -> Tensor:
    """The state's bias maximum ``(..., 1, 1)``; for a bias-free state 0, or ``-inf`` if empty."""
    if state.bias_max is not None:
        return state.bias_max
    seen = (state.k_sum != 0).any(dim=-1, keepdim=True).unsqueeze(-1)  # (..., 1, 1)
    return torch.zeros_like(seen, dtype=state.k_sum.dtype).masked_fill(~seen, float("-inf"))


def _prefix_state(fk: Tensor, v: Tensor, bias: Tensor | None) -> LinearAttentionState:
    """The state of keys that every query sees (all of them come before the first query)."""
    if bias is None:
        return LinearAttentionState(kv=torch.matmul(fk.transpose(-2, -1), v), k_sum=fk.sum(-2))
    top = bias.amax(dim=-2, keepdim=True)  # (..., 1, 1)
    fk = fk * torch.exp(bias - _finite(top))  # (..., n, D)
    return LinearAttentionState(kv=torch.matmul(fk.transpose(-2, -1), v), k_sum=fk.sum(-2),
                                bias_max=top)


def _features(phi: Callable[[Tensor], Tensor], x: Tensor, acc: torch.dtype,
              scale: float | None) -> Tensor:
    """``phi(scale * x)`` in the accumulation dtype (``phi(x)`` when ``scale`` is None)."""
    x = x.to(acc)
    return phi(x * scale if scale is not None else x)


def linear_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                     causal: bool = False, scale: float | None = None,
                     feature_map: FeatureMap = "elu", eps: float = 1e-6,
                     need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Kernel attention ``phi(q) (phi(k)^T v) / (phi(q) . sum phi(k) + eps)``.

    Args:
        q: queries ``(..., L_q, D)``.
        k: keys ``(..., L_k, D)``.
        v: values ``(..., L_k, D_v)``.
        mask: key mask broadcastable to ``(..., 1, L_k)``: bool (True = may attend) or float
            bias ``b`` (query ``i`` weights key ``j``'s kernel by ``exp(b_j - m_i)``, ``m_i``
            the largest bias it sees: shift-invariant like softmax, safe for any finite bias;
            ``-inf`` removes the key).
        causal: only keys ``j <= p`` (bottom-right aligned), computed in chunks.
        scale: multiplies ``q`` before the feature map, ``phi(scale * q)`` (a positive
            number); None means 1, the published kernel (see the module docstring for why
            not ``1 / sqrt(D)``).
        feature_map: ``"elu"`` (``elu(x) + 1``), ``"relu"`` or a callable ``phi``.
        eps: added to the denominator (> 0); rows with no allowed key give 0.
        need_weights: also return the dense normalised kernel matrix ``(..., L_q, L_k)``
            whose product with ``v`` is ``out`` (``O(L_q * L_k)`` memory).

    Returns:
        ``(out, weights)``: ``out`` ``(..., L_q, D_v)`` in the input dtype; ``weights`` or
        None.

    Raises:
        ValueError: for a mask that is not a key mask, mismatched shapes, ``eps <= 0`` or a
            ``scale`` that is not a positive finite number.
        TypeError: for non-floating inputs, a mask that is neither bool nor floating, or a
            feature map that is neither a known name nor callable.
    """
    check_qkv(q, k, v)
    # contiguous(): with the transposed heads MultiHeadAttention passes, torch.compile's
    # AOT backward fails with a stride error otherwise (torch 2.13); the copies are O(L * D).
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    phi = feature_map_fn(feature_map)
    eps = _check_eps(eps)
    scale = check_scale(scale)
    L_q, L_k = q.shape[-2], k.shape[-2]
    fq, fk, bias = _prepare(phi, q, k, mask, causal=causal, scale=scale)
    vc = v.to(fq.dtype)
    if not causal:
        S = torch.matmul(fk.transpose(-2, -1), vc)  # (..., D, D_v)
        z = fk.sum(dim=-2, keepdim=True).transpose(-2, -1)  # (..., D, 1)
        num, den = torch.matmul(fq, S), torch.matmul(fq, z)  # (..., L_q, D_v), (..., L_q, 1)
    else:
        off = L_k - L_q
        kernel = _causal
        if bias is not None:  # the stabilised form, on the keys from the first query's on
            kernel = partial(_causal_biased, bias=bias[..., max(off, 0):, :])
        if off >= 0:  # keys before the first query's position are seen by every query
            prefix = None
            if off:
                prefix = _prefix_state(fk[..., :off, :], vc[..., :off, :],
                                       None if bias is None else bias[..., :off, :])
            num, den, _ = kernel(fq, fk[..., off:, :], vc[..., off:, :], state=prefix)
        else:  # the first -off queries sit before key 0: they see nothing
            num, den, _ = kernel(fq[..., -off:, :], fk, vc, state=None)
            num = F.pad(num, (0, 0, -off, 0))  # (..., L_q, D_v)
            den = F.pad(den, (0, 0, -off, 0))  # (..., L_q, 1)
    out = (num / (den + eps)).to(v.dtype)  # (..., L_q, D_v)
    weights = None
    if need_weights:
        weights = _normalize(_dense_kernel(fq, fk, bias, causal), eps).to(q.dtype)
    return out, weights


def _prepare(phi: Callable[[Tensor], Tensor], q: Tensor, k: Tensor, mask: Tensor | None, *,
             causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(phi(scale * q), phi(k), bias)`` in the accumulation dtype, the key mask applied.

    A bool mask zeroes removed keys' features; a float bias is folded into ``phi(k)`` when
    every query sees every key (one maximum suffices), else returned ``(..., L_k, 1)`` for
    the causal forms, which need each query's own running maximum.
    """
    L_q, L_k = q.shape[-2], k.shape[-2]
    acc = _acc_dtype(q.dtype)
    keep, bias = _key_mask(mask, (*q.shape[:-2], L_q, L_k), acc)  # (..., L_k, 1) or None
    fq = _features(phi, q, acc, scale)  # (..., L_q, D)
    fk = _features(phi, k, acc, None)  # (..., L_k, D)
    if keep is not None:
        fk = fk * keep
    if bias is not None and not causal:  # every query sees every key: one maximum
        fk = fk * torch.exp(bias - _finite(bias.amax(dim=-2, keepdim=True)))
        bias = None
    return fq, fk, bias


def _normalize(kernel: Tensor, eps: float) -> Tensor:
    """Kernel -> weights: each row divided by its sum plus ``eps``."""
    return kernel / (kernel.sum(dim=-1, keepdim=True) + eps)


def _dense_kernel(fq: Tensor, fk: Tensor, bias: Tensor | None, causal: bool) -> Tensor:
    """The kernel matrix ``(..., L_q, L_k)`` whose normalised product with ``v`` is ``out``
    (0 where a key is removed)."""
    L_q, L_k = fq.shape[-2], fk.shape[-2]
    kernel = torch.matmul(fq, fk.transpose(-2, -1))  # (..., L_q, L_k)
    if causal:
        allowed = causal_mask(L_q, L_k, device=fq.device)  # (L_q, L_k)
        if bias is not None:  # per query: exp(b_j - M_t), M_t the largest bias it sees
            rows = (torch.arange(L_q, device=fq.device) + (L_k - L_q)).clamp_(0, L_k - 1)
            top = _finite(bias.cummax(dim=-2).values[..., rows, :])  # (..., L_q, 1)
            exponent = (bias.transpose(-2, -1) - top).masked_fill(~allowed, float("-inf"))
            kernel = kernel * torch.exp(exponent)
        else:
            kernel = kernel.masked_fill(~allowed, 0.0)
    return kernel


def linear_attention_step(q: Tensor, k: Tensor, v: Tensor,
                          state: LinearAttentionState | None = None, *,
                          mask: Tensor | None = None, scale: float | None = None,
                          feature_map: FeatureMap = "elu", eps: float = 1e-6
                          ) -> tuple[Tensor, LinearAttentionState]:
    """Recurrent causal linear attention: attend from new tokens, then update the state.

    For ``T`` new tokens (``T = 1`` when decoding one token at a time), new query ``t`` sees
    every earlier key (through ``state``) and the new keys ``<= t``. Feeding a sequence in one
    call or token by token gives the same outputs as ``linear_attention(..., causal=True)``,
    float biases included (the state keeps their running maximum).

    Args:
        q: new queries ``(..., T, D)``.
        k: new keys ``(..., T, D)``.
        v: new values ``(..., T, D_v)``.
        state: the state returned by the previous call (None = no earlier keys).
        mask: key mask for the new keys, broadcastable to ``(..., 1, T)`` (as in
            :func:`linear_attention`); removed keys are not added to the state.
        scale: as in :func:`linear_attention` (use the same one for every step).
        feature_map: as in :func:`linear_attention` (use the same one for every step).
        eps: as in :func:`linear_attention`.

    Returns:
        ``(out, state)``: ``out`` ``(..., T, D_v)`` in the input dtype, and the new state
        (float32, or float64 for float64 inputs). The old state is not modified.

    Raises:
        ValueError: if ``q`` and ``k`` differ in length, the state does not match the batch
            and head dims, or for the errors of :func:`linear_attention`.
    """
    check_qkv(q, k, v)
    phi = feature_map_fn(feature_map)
    eps = _check_eps(eps)
    scale = check_scale(scale)
    T, D, D_v = q.shape[-2], q.shape[-1], v.shape[-1]
    if k.shape[-2] != T:
        raise ValueError(
            f"a step attends from the new tokens to themselves and the state: q has T={T} "
            f"tokens, k has {k.shape[-2]}"
        )
    acc = _acc_dtype(q.dtype)
    if state is not None:
        want = (*q.shape[:-2], D, D_v)
        if tuple(state.kv.shape) != want or tuple(state.k_sum.shape) != want[:-1]:
            raise ValueError(
                f"state.kv {tuple(state.kv.shape)} / state.k_sum {tuple(state.k_sum.shape)} "
                f"do not match the inputs: expected {want} and {want[:-1]}"
            )
        state = LinearAttentionState(
            kv=state.kv.to(acc), k_sum=state.k_sum.to(acc),
            bias_max=None if state.bias_max is None else state.bias_max.to(acc))
    keep, bias = _key_mask(mask, (*q.shape[:-2], T, T), acc)  # (..., T, 1) or None
    fk = _features(phi, k, acc, None)  # (..., T, D)
    if keep is not None:
        fk = fk * keep
    fq = _features(phi, q, acc, scale)  # (..., T, D)
    if bias is None and (state is None or state.bias_max is None):
        num, den, new_state = _causal(fq, fk, v.to(acc), state)
    else:  # float biases now or before: the stabilised form (bias 0 for unbiased keys)
        if bias is None:
            bias = fk.new_zeros(*fk.shape[:-1], 1)
            if keep is not None:
                bias = bias.masked_fill(keep == 0, float("-inf"))  # (..., T, 1)
        num, den, new_state = _causal_biased(fq, fk, v.to(acc), bias, state)
    return (num / (den + eps)).to(v.dtype), new_state


class LinearAttention(AttentionKind):
    """Linear (kernel) attention as an attention kind (see :func:`linear_attention`).

    Args:
        feature_map: ``"elu"`` (``elu(x) + 1``, default), ``"relu"`` or a callable ``phi``.
        eps: denominator guard, > 0.

    Raises:
        ValueError: for an unknown feature-map name or ``eps <= 0``.
        TypeError: for a feature map that is neither a string nor callable.
    """

    supports_dropout = False

    def __init__(self, *, feature_map: FeatureMap = "elu", eps: float = 1e-6) -> None:
        super().__init__()
        feature_map_fn(feature_map)  # validate now, not at the first call
        self.feature_map = feature_map
        self.eps = _check_eps(eps)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                scale: float | None = None) -> tuple[Tensor, Tensor | None]:
        """See :func:`linear_attention`; ``dropout_p`` must be 0 (ValueError otherwise).

        ``scale`` multiplies ``q`` before the feature map (None = 1, not ``1 / sqrt(D)``).
        """
        check_no_dropout(self, dropout_p)
        return linear_attention(q, k, v, mask, causal=causal, scale=scale,
                                feature_map=self.feature_map, eps=self.eps,
                                need_weights=need_weights)

    def step(self, q: Tensor, k: Tensor, v: Tensor, state: LinearAttentionState | None = None,
             *, mask: Tensor | None = None, scale: float | None = None
             ) -> tuple[Tensor, LinearAttentionState]:
        """One recurrent step with this kind's feature map (see :func:`linear_attention_step`)."""
        return linear_attention_step(q, k, v, state, mask=mask, scale=scale,
                                     feature_map=self.feature_map, eps=self.eps)

    def pattern(self, L_q: int, L_k: int, *, causal: bool = False) -> Tensor | None:
        """``causal_mask(L_q, L_k)`` when causal, else None (every key)."""
        return causal_mask(L_q, L_k) if causal else None

    def scores(self, q: Tensor, k: Tensor, *, causal: bool = False,
               mask: Tensor | None = None, scale: float | None = None) -> Tensor:
        """The dense kernel matrix ``phi(scale * q_i) . phi(k_j)`` ``(..., L_q, L_k)``
        (float32, or float64 for float64 inputs), weighted by a float bias, 0 for keys a
        mask or ``causal`` removes."""
        phi = feature_map_fn(self.feature_map)
        fq, fk, bias = _prepare(phi, q, k, mask, causal=causal, scale=check_scale(scale))
        return _dense_kernel(fq, fk, bias, causal)

    def normalize(self, scores: Tensor) -> Tensor:
        """Kernel -> weights: each row divided by its sum (plus ``eps``)."""
        return _normalize(scores, self.eps)

    def extra_repr(self) -> str:
        name = self.feature_map if isinstance(self.feature_map, str) else "<callable>"
        return f"feature_map={name!r}, eps={self.eps}"
