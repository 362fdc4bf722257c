"""Scaled dot-product attention: the maths first, then an explicit path and torch's fused one.

    Attention(Q, K, V) = softmax(Q K^T * scale + bias) V,   scale = 1 / sqrt(D)

Read :func:`attention_reference` first: that formula in ten lines, nothing else.
:func:`scaled_dot_product_attention` computes the same numbers (tests/test_attention_reference.py
checks every path against it in float64), with what the ten lines leave out: argument checks,
torch's fused kernel when no weights are asked for, grouped-query heads, float32 softmax for
half-precision inputs, and zero gradients for a query row with no allowed key.

Shape letters: ``L_q`` queries, ``L_k`` keys, ``D`` query/key dim, ``D_v`` value dim; any
leading batch dims ``...`` (e.g. ``(B, H)``).

What differs from the seed's version (section 2 of the tutorial):

* The seed adds ``mask * -1e9``: with its 1 = keep masks that *blocks the kept keys*, and
  ``-1e9`` overflows to ``-inf`` in float16. Here masks are booleans (True = may attend),
  combined once and applied with ``-inf``; a row with no allowed key returns zeros and zero
  gradients instead of NaN.
* Softmax runs in float32 for float16/bfloat16 inputs.
* Without ``need_weights`` (and without dropout or a soft-cap) it calls torch's fused kernel.
* Optional attention-logit soft-capping (Gemma 2): ``softcap * tanh(scores / softcap)``,
  applied to the scaled scores before any mask or bias.
* Optional grouped-query attention (``enable_gqa=True``): ``k`` and ``v`` may have fewer heads
  ``H_kv`` (dim ``-3``) than ``q``'s ``H``, ``H_kv`` dividing ``H``; query head ``h`` reads
  key/value head ``h // (H / H_kv)``. The fused kernel takes them as they are; the explicit
  path repeats them (:func:`repeat_kv`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.checks import check_scale, check_softcap
from handformer.masks import causal_mask, check_mask

__all__ = ["attention_reference", "scaled_dot_product_attention", "check_qkv", "combine_masks",
           "masked_scores", "masked_softmax", "soft_cap", "repeat_kv", "kv_groups"]


def attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                        scale: float | None = None, softcap: float | None = None
                        ) -> tuple[Tensor, Tensor]:
    """The maths of attention, eagerly: ``softmax(q kᵀ · scale + mask) v``, no checks.

    What every other attention function here computes (the Annotated Transformer's
    ``attention()``, Hugging Face's ``eager_attention_forward``); a reference to read and to
    test against, not a fast path. Causal attention is a lower-triangular ``mask``.

    Args:
        q, k, v: queries ``(..., L_q, D)``, keys ``(..., L_k, D)``, values ``(..., L_k, D_v)``.
        mask: bool (True = may attend) or float (added to the scores), broadcastable to
            ``(..., L_q, L_k)``; None: every key.
        scale: the score scale; None: ``1 / sqrt(D)``.
        softcap: ``softcap * tanh(s / softcap)`` on the scaled scores, before the mask (Gemma 2).

    Returns:
        ``(out, weights)``: ``(..., L_q, D_v)`` and ``(..., L_q, L_k)``; a query row with no
        allowed key is zero in both.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (..., L_q, L_k)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))  # True = may attend
    elif mask is not None:
        scores = scores + mask  # an additive bias
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all -inf row: NaN -> 0
    return weights @ v, weights  # (..., L_q, D_v), (..., L_q, L_k)


def soft_cap(scores: Tensor, softcap: float | None) -> Tensor:
    """``softcap * tanh(scores / softcap)`` (None: ``scores`` unchanged).

    Bounds the logits to ``(-softcap, softcap)`` smoothly (Gemma 2's attention and final
    logits). ``-inf`` stays ``-inf`` only if masking comes after: apply it first.
    """
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def kv_groups(q: Tensor, k: Tensor) -> int:
    """Query heads per key/value head, ``H // H_kv`` (dim ``-3``; 1 for tensors below 3-D).

    Raises:
        ValueError: if ``H_kv`` does not divide ``H``.
    """
    if q.dim() < 3 or k.dim() < 3 or q.shape[-3] == k.shape[-3]:
        return 1
    H, H_kv = q.shape[-3], k.shape[-3]
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"grouped-query attention needs the key/value heads to divide the "
                         f"query heads: q {tuple(q.shape)} has {H}, k {tuple(k.shape)} has {H_kv}")
    return H // H_kv


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """``(..., H_kv, L, D)`` -> ``(..., H_kv * groups, L, D)``: each key/value head repeated for
    the ``groups`` query heads that read it (head ``h`` of the result is ``h // groups``).
    A copy; a no-op for ``groups == 1``."""
    if groups == 1:
        return x
    *batch, H_kv, L, D = x.shape
    expanded = x.unsqueeze(-3).expand(*batch, H_kv, groups, L, D)  # (..., H_kv, G, L, D)
    return expanded.reshape(*batch, H_kv * groups, L, D)  # (..., H, L, D)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, enable_gqa: bool = False) -> None:
    """Validate query/key/value shapes, dtypes and devices.

    With ``enable_gqa``, ``k`` and ``v`` may have fewer heads (dim ``-3``) than ``q``, a
    divisor of its number.

    Raises:
        TypeError: if an input is not a floating tensor, or the dtypes differ.
        ValueError: for a rank below 2, mismatched head dims, batch dims or key/value lengths,
            an empty key sequence, or inputs on different devices.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be (..., L, D), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head dim D: q {tuple(q.shape)} has D={q.shape[-1]}, "
            f"k {tuple(k.shape)} has D={k.shape[-1]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same length L_k: k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if enable_gqa and k.shape[:-2] == v.shape[:-2] and q.dim() == k.dim() >= 3 \
            and q.shape[:-3] == k.shape[:-3]:
        kv_groups(q, k)  # raises unless H_kv divides H
    elif not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"q, k and v must have the same batch dims: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[-2] == 0:
        raise ValueError(f"L_k == 0: k {tuple(k.shape)} has no keys to attend to")


def combine_masks(
    mask: Tensor | None, causal: bool, L_q: int, L_k: int, device: torch.device
) -> Tensor | None:
    """Fold ``causal`` into ``mask``; returns None, a bool mask or a float bias.

    A float bias gets ``-inf`` on the causally blocked entries; a bool mask is and-ed.
    """
    if not causal:
        return mask
    allowed = causal_mask(L_q, L_k, device=device)  # (L_q, L_k)
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def _empty_rows(mask: Tensor) -> Tensor:
    """True for query rows with no allowed key; shape ``mask.shape[:-1] + (1,)``."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def masked_scores(q: Tensor, k: Tensor, mask: Tensor | None, *, causal: bool = False,
                  allowed: Tensor | None = None, scale: float | None = None,
                  softcap: float | None = None) -> Tensor:
    """The pre-softmax scores ``cap(q k^T * scale) + bias``, ``-inf`` where a key is not allowed.

    Computed in float32 for float16/bfloat16 inputs (as the softmax after it).

    Args:
        q: ``(..., L_q, D)``; k: ``(..., L_k, D)``.
        mask: bool (True = may attend) or float bias, broadcastable to ``(..., L_q, L_k)``.
        causal: block keys after each query's position (bottom-right aligned).
        allowed: an attention kind's boolean ``(L_q, L_k)`` pattern (None = every key).
        scale: defaults to ``1 / sqrt(D)``.
        softcap: soft-cap ``softcap * tanh(s / softcap)`` of the scaled scores, before the
            mask (None: no cap).

    Returns:
        ``(..., L_q, L_k)`` scores; rows with no allowed key are all ``-inf``.
    """
    L_q, L_k = q.shape[-2], k.shape[-2]
    if mask is not None:
        check_mask(mask, (*q.shape[:-2], L_q, L_k))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q = q.to(compute)
    if math.frexp(scale)[0] == 0.5:  # a power of two (1/8 for D = 64): scaling q first gives
        # the same bits (no rounding either way) on an L_k / D times smaller tensor
        scores = torch.matmul(q * scale, k.to(compute).transpose(-2, -1))
    else:  # in place on the fresh product: one (..., L_q, L_k) tensor less to allocate
        scores = torch.matmul(q, k.to(compute).transpose(-2, -1)).mul_(scale)
    scores = soft_cap(scores, softcap)  # (..., L_q, L_k)
    combined = combine_masks(mask, causal, L_q, L_k, q.device)
    if allowed is not None:
        allowed = allowed.to(q.device)
        if combined is None or combined.dtype == torch.bool:
            combined = allowed if combined is None else combined & allowed
        else:
            combined = combined.masked_fill(~allowed, float("-inf"))
    if combined is None:
        return scores
    if combined.dtype == torch.bool:
        # = scores.masked_fill(~combined, -inf), value for value; torch.where is one pass
        # where masked_fill with a broadcast mask is a copy and a slow second pass on the CPU.
        return torch.where(combined, scores, float("-inf"))
    return scores + combined.to(compute)


def masked_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim where rows that are all ``-inf`` (no allowed key) give 0.

    Args:
        scores: ``(..., L_q, L_k)`` from :func:`masked_scores`.

    Returns:
        The attention weights, same shape and dtype.
    """
    # A row is all -inf iff its maximum is: one reduction instead of a bool tensor of
    # the scores' size and a reduction over it.
    empty = torch.isneginf(scores.amax(dim=-1, keepdim=True))  # (..., L_q, 1)
    if scores.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(empty.any()):
        # The common case (causal or padding masks): no row to fix, so skip the two
        # passes that fix them (the check would cost a device sync on accelerators, and
        # break the graph inside torch.compile, so the general path runs there).
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    softcap: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention with handformer's mask convention.

    Args:
        q: queries ``(..., L_q, D)``.
        k: keys ``(..., L_k, D)``.
        v: values ``(..., L_k, D_v)``.
        mask: bool (True = may attend) or float (additive bias), broadcastable to
            ``(..., L_q, L_k)``.
        causal: block key ``j`` for query ``i`` when ``j > i + L_k - L_q`` (bottom-right).
        scale: score scale (a positive number); None means ``1 / sqrt(D)``.
        dropout_p: dropout on the attention weights (pass 0 in eval mode).
        need_weights: also return the attention weights (before dropout).
        softcap: cap the scaled scores with ``softcap * tanh(s / softcap)`` before the mask
            (None: no cap; a cap takes the explicit path).
        enable_gqa: ``k`` and ``v`` may have ``H_kv`` heads (dim ``-3``) dividing ``q``'s
            ``H`` (grouped-query attention); the weights are per query head.

    Returns:
        ``(out, weights)``: ``out`` is ``(..., L_q, D_v)``; ``weights`` is ``(..., L_q, L_k)``
        when ``need_weights`` else None. Rows with no allowed key are all zero in both.

    Raises:
        TypeError: for non-tensor or integer inputs, mixed dtypes, or a mask that is neither
            bool nor floating.
        ValueError: for mismatched shapes, a mask that does not broadcast, ``L_k == 0``,
            ``dropout_p`` outside [0, 1), a ``scale`` or ``softcap`` that is not a positive
            finite number, or key/value heads that do not divide the query heads.
    """
    check_qkv(q, k, v, enable_gqa=enable_gqa)
    L_q, L_k = q.shape[-2], k.shape[-2]
    score_shape = (*q.shape[:-2], L_q, L_k)
    if mask is not None:
        check_mask(mask, score_shape)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    scale = check_scale(scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    softcap = check_softcap(softcap)
    gqa = enable_gqa and kv_groups(q, k) > 1

    if not need_weights and dropout_p == 0.0 and softcap is None:
        return _fused(q, k, v, mask, causal, scale, gqa), None
    groups = kv_groups(q, k) if gqa else 1
    return _math(q, repeat_kv(k, groups), repeat_kv(v, groups), mask, causal, scale,
                 dropout_p, need_weights, softcap)


def _fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
           scale: float, gqa: bool = False) -> Tensor:
    """torch's fused kernel, with rows that have no allowed key forced to zero."""
    L_q, L_k = q.shape[-2], k.shape[-2]
    if mask is None and causal and L_q == L_k:
        # Top-left and bottom-right alignment agree for square scores: use the fast flag.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    combined = combine_masks(mask, causal, L_q, L_k, q.device)
    if combined is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    empty = _empty_rows(combined)  # (..., L_q, 1)
    if q.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(empty.any()):
        # The common case (e.g. padding masks): no row to fix, so skip the two extra passes
        # over the output (the check would cost a device sync on accelerators; inside
        # torch.compile it would break the graph, so the general path runs there).
        return F.scaled_dot_product_attention(q, k, v, attn_mask=combined.to(q.dtype)
                                              if combined.is_floating_point() else combined,
                                              scale=scale, enable_gqa=gqa)
    # Let empty rows attend everywhere (finite softmax, no NaN), then zero their output:
    # the zero incoming gradient makes their gradients zero too.
    if combined.dtype == torch.bool:
        safe = combined | empty
    else:
        safe = combined.masked_fill(empty, 0.0).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scale, enable_gqa=gqa)
    return out.masked_fill(empty, 0.0)


def _math(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
          dropout_p: float, need_weights: bool, softcap: float | None = None
          ) -> tuple[Tensor, Tensor | None]:
    """Explicit softmax(cap(q k^T * scale) + bias) v, in float32 for half-precision inputs."""
    L_q, L_k = q.shape[-2], k.shape[-2]
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale
    scores = soft_cap(scores, softcap)  # (..., L_q, L_k)
    combined = combine_masks(mask, causal, L_q, L_k, q.device)
    if combined is None:
        weights = torch.softmax(scores, dim=-1)
    elif combined.dtype == torch.bool:
        empty = _empty_rows(combined)  # (..., L_q, 1)
        scores = scores.masked_fill(~(combined | empty), float("-inf"))
        weights = torch.softmax(scores, dim=-1).masked_fill(~combined, 0.0)
    else:
        empty = _empty_rows(combined)  # (..., L_q, 1)
        scores = scores + combined.to(compute).masked_fill(empty, 0.0)
        weights = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
    out = torch.matmul(dropped, v.to(compute)).to(v.dtype)  # (..., L_q, D_v)
    return out, (weights.to(q.dtype) if need_weights else None)
