"""Strided sparse attention (Sparse Transformers' "strided" pattern) with global tokens.

Pattern (positions aligned bottom-right: query ``i`` sits at key position
``p = i + L_k - L_q``): query ``i`` may attend key ``j`` iff ``|p - j| < stride``, or
``(p - j) % stride == 0``, or ``p < global_tokens``, or ``j < global_tokens``; and ``j <= p``
when ``causal``. A ``mask`` restricts it further. Softmax attention with scale ``1/sqrt(D)``
unless ``scale`` is given.
:func:`handformer.masks.strided_mask` builds the same pattern densely.

How it is computed (no divisibility requirements): the allowed keys of a query are split into
disjoint sets, each attended with its own softmax; the partial results are merged exactly
through their log-sum-exp (as in blocked "flash" attention):

* **global rows** (``p < global_tokens``): ordinary attention over all keys, in query blocks;
* **global columns** (``j < global_tokens``): a dense ``L_q x global_tokens`` block;
* **the band** ``|p - j| < stride``, ``j >= global_tokens``: the tiled engine of local
  attention (``128 x (128 + 2 * stride)`` score tiles);
* **the stride** ``j = p +- stride, p +- 2 stride, ...``: queries and keys are regrouped by
  their residue ``position % stride``. After zero-padding to a multiple of ``stride``, that
  regrouping is a free ``view`` + transpose (a gather with no index tensor), and each residue
  class is one small dense problem of ``ceil(L_q / stride) x ceil(L_k / stride)``, all of them
  batched in one matmul (chunked to bound memory).

This "gather by reshape" beats block-sparse here because the strided keys of a query are
spread one per ``stride`` positions: a block-sparse layout would have to multiply whole
``block x block`` tiles to use one column in each, wasting ``block``-fold work, whereas the
residue grouping computes only the entries of the pattern.

Complexity: time ``O(L_q * (2 * stride + L_k / stride + global_tokens) * D)`` -- with
``stride ~ sqrt(L)`` that is ``O(L^1.5 * D)`` -- and working memory of one bounded tile; the
dense weights are built only when ``need_weights=True``.

How it differs from the seed's ``sparse_attention`` (section 7 of the tutorial): the seed marks
*rows* ``0, stride, 2 stride, ...`` with 1 and turns the mask into ``(1 - mask) * -1e9``, then
its attention adds ``mask * -1e9`` again: the marked rows get a zero bias (full attention) and
every other row gets ``+1e18`` on every key, which leaves uniform weights -- no row follows a
sparse pattern at all. It also builds ``L x L`` scores, so it costs as much as full attention.

Shape letters: ``L_q`` queries, ``L_k`` keys, ``R`` queries after the global rows, ``s``
stride, ``n_q`` / ``n_k`` queries / keys per residue class, ``D`` head dim, ``D_v`` value dim,
leading batch dims ``...``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.attention._tiles import (
    Partial,
    as_2d_mask,
    band_partial,
    mask_tile,
    merge_partials,
    prepare,
    score_scale,
    tile_softmax,
)
from handformer.attention.functional import check_qkv
from handformer.attention.kinds import AttentionKind, check_no_dropout
from handformer.checks import check_non_negative_int, check_positive_int
from handformer.masks import check_mask, strided_mask

__all__ = ["strided_attention", "StridedAttention"]

_TILE_ELEMENTS = 1 << 20  # score entries per residue-class chunk (4 MB in float32)


def strided_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                      stride: int, global_tokens: int = 0, causal: bool = False,
                      scale: float | None = None, need_weights: bool = False
                      ) -> tuple[Tensor, Tensor | None]:
    """Strided sparse softmax attention with optional global tokens.

    Args:
        q: queries ``(..., L_q, D)``.
        k: keys ``(..., L_k, D)``.
        v: values ``(..., L_k, D_v)``.
        mask: bool (True = may attend) or float (additive bias) mask broadcastable to
            ``(..., L_q, L_k)``; it restricts the pattern further.
        stride: ``s >= 1`` (keyword-only): a query sees keys closer than ``s`` and every
            ``s``-th key from its position (``stride=1`` is full attention; ``stride > L`` is
            a band of width ``2 L``, i.e. full attention as well).
        global_tokens: the first ``global_tokens`` positions attend everything and are
            attended by everything.
        causal: also require ``j <= p`` (bottom-right aligned).
        scale: score scale (a positive number); None means ``1 / sqrt(D)``.
        need_weights: also return the dense ``(..., L_q, L_k)`` weights (zeros outside the
            pattern); this costs ``O(L_q * L_k)`` memory.

    Returns:
        ``(out, weights)``: ``out`` is ``(..., L_q, D_v)`` in the input dtype; rows with no
        allowed key are zero. ``weights`` is None unless ``need_weights``.

    Raises:
        ValueError: for a ``stride`` that is not a positive integer, a negative
            ``global_tokens``, a ``scale`` that is not a positive finite number, mismatched
            shapes or a mask that does not broadcast.
        TypeError: for non-floating inputs, a mask that is neither bool nor floating, or no
            ``stride`` keyword (e.g. the stride given by position, in ``mask``'s place).
    """
    check_qkv(q, k, v)
    s = check_positive_int("stride", stride)
    g = check_non_negative_int("global_tokens", global_tokens)
    scale = score_scale(scale, q.shape[-1])
    L_q, L_k = q.shape[-2], k.shape[-2]
    if mask is not None:
        check_mask(mask, (*q.shape[:-2], L_q, L_k))
    mask = as_2d_mask(mask)
    qs, kc, vc = prepare(q, k, v, scale=scale)
    off = L_k - L_q
    everything = 0 if causal else None  # hi limit of "all keys" (j <= p when causal)
    n_glob = min(max(g - off, 0), L_q)  # rows with p < global_tokens
    pieces: list[Partial] = []
    if n_glob:
        pieces.append(band_partial(qs[..., :n_glob, :], kc, vc, pos_offset=off, lo=None,
                                   hi=everything, mask=mask_tile(mask, 0, n_glob, 0, L_k),
                                   need_weights=need_weights))
    if n_glob < L_q:
        q_rest = qs[..., n_glob:, :]  # (..., R, D)
        m_rest = mask_tile(mask, n_glob, L_q, 0, L_k)
        start = off + n_glob  # key position of the first remaining query
        parts = [band_partial(q_rest, kc, vc, pos_offset=start, lo=-(s - 1),
                              hi=0 if causal else s - 1, key_start=g, mask=m_rest,
                              need_lse=True, need_weights=need_weights)]
        if g:
            parts.append(band_partial(q_rest, kc, vc, pos_offset=start, lo=None,
                                      hi=everything, key_stop=g, mask=m_rest, need_lse=True,
                                      need_weights=need_weights))
        last = off + L_q - 1
        reach = last - g if causal else max(last - g, L_k - 1 - start)  # largest |p - j|
        if s <= reach:
            parts.append(_residue_partial(q_rest, kc, vc, s, g, start, causal, m_rest,
                                          need_weights))
        pieces.append(merge_partials(parts) if len(parts) > 1 else parts[0])
    out = torch.cat([p.out for p in pieces], dim=-2)  # (..., L_q, D_v)
    weights = None
    if need_weights:
        weights = torch.cat([p.weights for p in pieces], dim=-2).to(q.dtype)  # (..., L_q, L_k)
    return out.to(v.dtype), weights


def _residue_partial(q: Tensor, k: Tensor, v: Tensor, s: int, g: int, start: int,
                     causal: bool, mask: Tensor | None, need_weights: bool) -> Partial:
    """Attention to keys ``j = p +- m s`` (``m >= 1``, ``j >= g``), batched per residue class."""
    R, L_k = q.shape[-2], k.shape[-2]
    a0 = start // s  # query class index of the first padded row (floor, also for start < 0)
    pad_q = start - a0 * s
    n_q, n_k = math.ceil((pad_q + R) / s), math.ceil(L_k / s)
    qr = F.pad(q, (0, 0, pad_q, n_q * s - pad_q - R))  # (..., n_q * s, D)
    qr = qr.unflatten(-2, (n_q, s)).transpose(-3, -2).contiguous()  # (..., s, n_q, D)
    kr = F.pad(k, (0, 0, 0, n_k * s - L_k)).unflatten(-2, (n_k, s)).transpose(-3, -2)
    vr = F.pad(v, (0, 0, 0, n_k * s - L_k)).unflatten(-2, (n_k, s)).transpose(-3, -2)
    kr, vr = kr.contiguous(), vr.contiguous()  # one copy, not one per chunk
    # kr: (..., s, n_k, D), vr: (..., s, n_k, D_v); class r holds positions r, r + s, ...
    dev = q.device
    r = torch.arange(s, device=dev).view(s, 1, 1)
    a = torch.arange(n_q, device=dev).view(1, n_q, 1) + a0  # p = r + s * a
    b = torch.arange(n_k, device=dev).view(1, 1, n_k)  # j = r + s * b
    j = r + s * b  # (s, 1, n_k)
    blocked = (b == a) | (j < g) | (j >= L_k)  # (s, n_q, n_k)
    if causal:
        blocked |= b >= a
    user = _mask_by_residue(mask, s, pad_q, n_q, n_k, R, L_k)
    batch = q.shape[:-2]
    per_row = max(1, math.prod(batch)) * s * n_k
    chunk = max(1, _TILE_ELEMENTS // per_row)
    outs, lses, weights = [], [], []
    for c0 in range(0, n_q, chunk):
        c1 = min(c0 + chunk, n_q)
        scores = torch.matmul(qr[..., c0:c1, :], kr.transpose(-2, -1))  # (..., s, c, n_k)
        user_c = None if user is None else (user[..., c0:c1, :] if user.shape[-2] > 1 else user)
        blocked_c = blocked[:, c0:c1]
        empty_c = None
        if user_c is None:
            empty_c = blocked_c.all(dim=-1, keepdim=True)  # (s, c, 1)
            if not (torch.compiler.is_compiling() or bool(empty_c.any())):  # data-dependent
                empty_c = None
        w, lse = tile_softmax(scores, blocked_c, user_c, need_lse=True, empty=empty_c)
        outs.append(torch.matmul(w, vr))  # (..., s, c, D_v)
        lses.append(lse)  # (..., s, c, 1)
        if need_weights:
            weights.append(w)
    out = torch.cat(outs, dim=-2).transpose(-3, -2).flatten(-3, -2)  # (..., n_q * s, D_v)
    lse = torch.cat(lses, dim=-2).transpose(-3, -2).flatten(-3, -2)  # (..., n_q * s, 1)
    dense = None
    if need_weights:
        w = torch.cat(weights, dim=-2).movedim(-3, -1)  # (..., n_q, n_k, s)
        dense = torch.diag_embed(w, dim1=-3, dim2=-1)  # (..., n_q, s, n_k, s)
        dense = dense.flatten(-4, -3).flatten(-2, -1)  # (..., n_q * s, n_k * s)
        dense = dense[..., pad_q:pad_q + R, :L_k]  # (..., R, L_k)
    return Partial(out=out[..., pad_q:pad_q + R, :], lse=lse[..., pad_q:pad_q + R, :],
                   weights=dense)


def _mask_by_residue(mask: Tensor | None, s: int, pad_q: int, n_q: int, n_k: int, R: int,
                     L_k: int) -> Tensor | None:
    """Regroup a ``(..., R | 1, L_k | 1)`` mask like the queries and keys: ``(..., s|1, n_q|1,
    n_k|1)``, entry ``[r, a, b]`` = mask at query position ``r + s a`` and key ``r + s b``."""
    if mask is None:
        return None
    x = mask
    if x.shape[-1] > 1:
        x = F.pad(x, (0, n_k * s - L_k)).unflatten(-1, (n_k, s))  # (..., Mq, n_k, s)
    else:
        x = x.unsqueeze(-1)  # (..., Mq, 1, 1)
    if x.shape[-3] > 1:
        x = F.pad(x, (0, 0, 0, 0, pad_q, n_q * s - pad_q - R))  # (..., n_q * s, Bk, Sk)
        x = x.unflatten(-3, (n_q, s))  # (..., n_q, s, Bk, Sk)
    else:
        x = x.unsqueeze(-3)  # (..., 1, 1, Bk, Sk)
    # x: (..., A, Sq, Bk, Sk), A in {1, n_q}, Bk in {1, n_k}, Sq and Sk in {1, s}
    if x.shape[-3] == s and x.shape[-1] == s and s > 1:
        return x.diagonal(dim1=-3, dim2=-1).movedim(-1, -3)  # (..., s, A, Bk)
    if x.shape[-1] == s and s > 1:
        return x.squeeze(-3).movedim(-1, -3)  # (..., s, A, Bk)
    return x.squeeze(-1).transpose(-3, -2)  # (..., Sq, A, Bk)


class StridedAttention(AttentionKind):
    """Strided sparse attention as an attention kind (see :func:`strided_attention`).

    Args:
        stride: ``s >= 1``.
        global_tokens: number of leading global positions (``>= 0``).

    Raises:
        ValueError: if ``stride`` is not a positive integer or ``global_tokens`` is negative
            or not an integer.
    """

    supports_dropout = False

    def __init__(self, stride: int, *, global_tokens: int = 0) -> None:
        super().__init__()
        self.stride = check_positive_int("stride", stride)
        self.global_tokens = check_non_negative_int("global_tokens", global_tokens)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                scale: float | None = None) -> tuple[Tensor, Tensor | None]:
        """See :func:`strided_attention`; ``dropout_p`` must be 0 (ValueError otherwise)."""
        check_no_dropout(self, dropout_p)
        return strided_attention(q, k, v, mask, stride=self.stride,
                                 global_tokens=self.global_tokens, causal=causal, scale=scale,
                                 need_weights=need_weights)

    def pattern(self, L_q: int, L_k: int, *, causal: bool = False) -> Tensor:
        """The dense bool ``(L_q, L_k)`` pattern (:func:`handformer.masks.strided_mask`)."""
        return strided_mask(L_q, L_k, self.stride, global_tokens=self.global_tokens,
                            causal=causal)

    def extra_repr(self) -> str:
        return f"stride={self.stride}, global_tokens={self.global_tokens}"
