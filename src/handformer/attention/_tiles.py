"""Tiled softmax attention over a band of keys: the engine of local and strided attention.

Query ``i`` sits at key position ``p = i + pos_offset``; it may attend key ``j`` iff
``key_start <= j < key_stop`` and ``lo <= j - p <= hi`` (``None`` = unbounded), further
restricted by a user mask. Queries are processed in blocks of :data:`BLOCK` rows; each block
only multiplies against the contiguous key range its band can reach, so the score tile is
``BLOCK x (BLOCK + hi - lo)`` and stays in cache. Nothing of size ``L_q x L_k`` is built unless
the dense weights are asked for.

Without a user mask, weights or log-sum-exp, each block is one call of torch's fused
attention kernel on its key window with a shared band template as mask (:func:`_fused_tiles`).

Each call returns a :class:`Partial`: the output normalised over the allowed keys, optionally
the log-sum-exp of the allowed scores (``-inf`` for rows with no allowed key), which lets
several disjoint partials be merged into one softmax (:func:`merge_partials`), and optionally
the dense weights.

Shape letters: ``L_q`` queries, ``L_k`` keys, ``D`` head dim, ``D_v`` value dim, ``n`` rows of a
block, ``m`` keys of a block; leading batch dims ``...``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.attention.functional import soft_cap
from handformer.checks import check_scale

__all__ = ["BLOCK", "GROUP", "Partial", "prepare", "score_scale", "as_2d_mask", "mask_tile",
           "tile_softmax", "band_partial", "merge_partials"]

BLOCK = 128  # query rows per tile; measured best on the 2-core CPU (see design.md)
GROUP = 1  # tiles per step in the maskless path (1: no copy of the key windows)


@dataclass
class Partial:
    """Softmax attention restricted to one set of keys.

    Attributes:
        out: ``(..., L_q, D_v)`` output normalised over this set (zeros for empty rows).
        lse: ``(..., L_q, 1)`` log-sum-exp of the allowed scores (``-inf`` if empty), or None.
        weights: ``(..., L_q, L_k)`` dense weights normalised over this set, or None.
    """

    out: Tensor
    lse: Tensor | None = None
    weights: Tensor | None = None


def prepare(q: Tensor, k: Tensor, v: Tensor, *, scale: float = 1.0
            ) -> tuple[Tensor, Tensor, Tensor]:
    """Cast half inputs to float32 (softmax precision); multiply ``q`` by ``scale`` if not 1."""
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q = q.to(compute)
    return (q * scale if scale != 1.0 else q), k.to(compute), v.to(compute)


def score_scale(scale: float | None, D: int) -> float:
    """The softmax kinds' score scale: ``scale`` (checked), or ``1 / sqrt(D)`` when None."""
    scale = check_scale(scale)
    return 1.0 / math.sqrt(D) if scale is None else scale


def as_2d_mask(mask: Tensor | None) -> Tensor | None:
    """Give a mask at least two dims, so its last two are always ``(L_q or 1, L_k or 1)``."""
    if mask is None or mask.dim() >= 2:
        return mask
    return mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))  # (..., 1|L_q, 1|L_k)


def mask_tile(mask: Tensor | None, r0: int, r1: int, c0: int, c1: int) -> Tensor | None:
    """Rows ``r0:r1`` and columns ``c0:c1`` of a broadcastable mask (size-1 dims kept)."""
    if mask is None:
        return None
    if mask.shape[-2] != 1:
        mask = mask[..., r0:r1, :]
    if mask.shape[-1] != 1:
        mask = mask[..., c0:c1]
    return mask


def tile_softmax(scores: Tensor, blocked: Tensor | None, user: Tensor | None,
                 need_lse: bool, *, empty: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Masked softmax of one score tile, in place on ``scores``.

    Args:
        scores: ``(..., n, m)`` scaled scores (modified in place).
        blocked: bool pattern broadcastable to ``scores``, True = *not* allowed (None = all
            allowed).
        user: the user's mask tile: bool (True = may attend) or float bias, or None.
        need_lse: also return the log-sum-exp over the allowed entries.
        empty: when ``user`` is None, the ``(n, 1)`` rows that ``blocked`` leaves empty, or None
            if there are none (computed here when not given and ``user`` is set).

    Returns:
        ``(weights, lse)``; rows with no allowed entry get zero weights and ``lse = -inf``.
    """
    if user is not None:
        if user.dtype == torch.bool:
            blocked = ~user if blocked is None else blocked | ~user
        else:
            scores.add_(user)
    if blocked is not None:
        scores.masked_fill_(blocked, float("-inf"))
    if user is not None:
        if user.dtype != torch.bool:
            empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., n, 1)
        else:
            empty = blocked.all(dim=-1, keepdim=True)  # (..., n, 1)
        if not (torch.compiler.is_compiling() or bool(empty.any())):  # data-dependent
            empty = None
    if empty is not None:
        scores.masked_fill_(empty, 0.0)  # a finite row: no NaN in softmax or its gradient
    weights = torch.softmax(scores, dim=-1)
    lse = _lse(scores, weights) if need_lse else None  # (..., n, 1)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)
        if lse is not None:
            lse = lse.masked_fill(empty, float("-inf"))
    return weights, lse


def _lse(scores: Tensor, weights: Tensor) -> Tensor:
    """``logsumexp(scores)`` per row from ``weights = softmax(scores)``, in two reductions.

    At the row's largest score ``s_max`` the weight is ``exp(s_max - lse)``, so
    ``lse = s_max - log(w_max)``; ``w_max >= 1 / m`` keeps the log well conditioned, and the
    identity holds near the point, so its gradient is the exact one too.
    """
    return scores.amax(dim=-1, keepdim=True) - torch.log(weights.amax(dim=-1, keepdim=True))


def band_partial(q: Tensor, k: Tensor, v: Tensor, *, pos_offset: int, lo: int | None,
                 hi: int | None, key_start: int = 0, key_stop: int | None = None,
                 mask: Tensor | None = None, need_lse: bool = False,
                 need_weights: bool = False, block: int = BLOCK, scale: float = 1.0,
                 softcap: float | None = None) -> Partial:
    """Softmax attention over the band ``lo <= j - p <= hi``, ``key_start <= j < key_stop``.

    Args:
        q: prepared queries ``(..., L_q, D)`` (see :func:`prepare`).
        k: keys ``(..., L_k, D)``; v: values ``(..., L_k, D_v)``.
        pos_offset: key position of query 0 (``p = i + pos_offset``).
        lo, hi: band limits on ``j - p`` (None = unbounded).
        key_start, key_stop: the key range (default all keys).
        mask: user mask, at least 2-D, broadcastable to ``(..., L_q, L_k)``.
        need_lse: also return the log-sum-exp per row (for :func:`merge_partials`).
        need_weights: also return dense ``(..., L_q, L_k)`` weights.
        block: query rows per tile.
        scale: a factor still to apply to the scores (1 when ``q`` is prepared).
        softcap: soft-cap ``softcap * tanh(s / softcap)`` of each scaled score tile before
            masking (None: none; a cap takes the explicit tile path).

    Returns:
        A :class:`Partial`.
    """
    L_q, L_k = q.shape[-2], k.shape[-2]
    key_stop = L_k if key_stop is None else min(key_stop, L_k)
    key_start = max(key_start, 0)
    # (wider bands: the per-block clipping wins)
    if (mask is None and not need_weights and softcap is None and lo is not None
            and hi is not None and hi - lo < key_stop - key_start):
        return _uniform_band(q, k, v, pos_offset, lo, hi, key_start, key_stop, need_lse, block,
                             scale)
    if scale != 1.0:
        q = q * scale
    batch = q.shape[:-2]
    outs, lses, weights = [], [], []
    templates: dict[tuple[int, int, int], tuple[Tensor | None, Tensor | None]] = {}
    for r0 in range(0, L_q, block):
        r1 = min(r0 + block, L_q)
        n = r1 - r0
        p0, p1 = r0 + pos_offset, r1 - 1 + pos_offset  # first and last query position
        c0 = key_start if lo is None else max(key_start, p0 + lo)
        c1 = key_stop if hi is None else min(key_stop, p1 + hi + 1)
        if c1 <= c0:  # no key reachable from this block
            outs.append(v.new_zeros(*batch, n, v.shape[-1]))  # (..., n, D_v)
            if need_lse:
                lses.append(q.new_full((*batch, n, 1), float("-inf")))  # (..., n, 1)
            if need_weights:
                weights.append(q.new_zeros(*batch, n, L_k))  # (..., n, L_k)
            continue
        shift = c0 - p0  # j - p of the tile's top-left entry
        key = (n, c1 - c0, shift)
        if key not in templates:
            templates[key] = _band_template(n, c1 - c0, shift, lo, hi, q.device)
        scores = torch.matmul(q[..., r0:r1, :], k[..., c0:c1, :].transpose(-2, -1))
        scores = soft_cap(scores, softcap)  # (..., n, m)
        blocked, empty = templates[key]
        w, lse = tile_softmax(scores, blocked, mask_tile(mask, r0, r1, c0, c1), need_lse,
                              empty=empty)
        outs.append(torch.matmul(w, v[..., c0:c1, :]))  # (..., n, D_v)
        if need_lse:
            lses.append(lse)
        if need_weights:
            weights.append(F.pad(w, (c0, L_k - c1)))  # (..., n, L_k)
    out = torch.cat(outs, dim=-2) if outs else v.new_zeros(*batch, 0, v.shape[-1])
    return Partial(
        out=out,  # (..., L_q, D_v)
        lse=torch.cat(lses, dim=-2) if need_lse and lses else None,  # (..., L_q, 1)
        weights=torch.cat(weights, dim=-2) if need_weights and weights else None,
    )


def _uniform_band(q: Tensor, k: Tensor, v: Tensor, pos_offset: int, lo: int, hi: int,
                  key_start: int, key_stop: int, need_lse: bool, block: int, scale: float
                  ) -> Partial:
    """:func:`band_partial` without a user mask or weights, :data:`GROUP` blocks per step.

    Every block of ``n`` queries sees a window of ``m = n + hi - lo`` keys at the same offset,
    so after zero-padding the keys the windows are one strided view (``unfold``) and a single
    ``(n, m)`` template masks the band. Keys outside ``[key_start, key_stop)`` get ``-inf``
    (only in the blocks that have some); rows that reach no key are skipped and return zeros.
    """
    L_q = q.shape[-2]
    batch, D_v = q.shape[:-2], v.shape[-1]
    # rows whose band meets [key_start, key_stop): a contiguous range, as p grows with i
    i0 = max(0, key_start - hi - pos_offset)
    i1 = min(L_q, key_stop - lo - pos_offset)
    if i1 <= i0 or key_stop <= key_start or hi < lo:
        return Partial(out=v.new_zeros(*batch, L_q, D_v),
                       lse=q.new_full((*batch, L_q, 1), float("-inf")) if need_lse else None)
    R = i1 - i0
    n = min(block, R)
    nb = math.ceil(R / n)
    m = n + hi - lo
    start = i0 + pos_offset + lo  # key position of the first window's first column
    end = start + (nb - 1) * n + m
    a, b = max(start, key_start), min(end, key_stop)  # real keys used (a < b: row i0 has one)
    pad = (a - start, end - b)
    if not need_lse:
        return Partial(out=_fused_tiles(q, k, v, i0, i1, n, m, start, hi - lo, key_start,
                                        key_stop, scale))
    if scale != 1.0:
        q = q * scale
    kp = F.pad(k[..., a:b, :], (0, 0, *pad))  # (..., (nb - 1) * n + m, D), window b at b * n
    vp = F.pad(v[..., a:b, :], (0, 0, *pad))  # (..., (nb - 1) * n + m, D_v)
    # block index first, so that a group of blocks is one contiguous batch for matmul
    kw = kp.unfold(-2, m, n).movedim(-3, 0)  # (nb, ..., D, m), overlapping windows
    vw = vp.unfold(-2, m, n).movedim(-3, 0).transpose(-2, -1)  # (nb, ..., m, D_v)
    qb = F.pad(q[..., i0:i1, :], (0, 0, 0, nb * n - R)).unflatten(-2, (nb, n))
    qb = qb.movedim(-3, 0).contiguous()  # (nb, ..., n, D)
    ones = (1,) * len(batch)
    t = torch.arange(m, device=q.device)
    r = torch.arange(n, device=q.device).unsqueeze(-1)
    band = (t < r) | (t > r + (hi - lo))  # (n, m), True = outside the band
    cols = start + torch.arange(nb, device=q.device).unsqueeze(-1) * n + t  # (nb, m)
    outside = (cols < key_start) | (cols >= key_stop)  # (nb, m)
    has_outside = outside.any(dim=-1).tolist()
    outside = outside.view(nb, *ones, 1, m)  # (nb, ..., 1, m)
    pad_rows = (torch.arange(nb * n, device=q.device) >= R).view(nb, *ones, n, 1)
    outs, lses = [], []
    for g0 in range(0, nb, GROUP):
        g1 = min(g0 + GROUP, nb)
        scores = torch.matmul(qb[g0:g1], kw[g0:g1])  # (G, ..., n, m)
        scores.masked_fill_(band, float("-inf"))
        if any(has_outside[g0:g1]):
            scores.masked_fill_(outside[g0:g1], float("-inf"))
        if g1 == nb and nb * n > R:
            scores.masked_fill_(pad_rows[g0:g1], 0.0)  # padded rows: finite, discarded
        weights = torch.softmax(scores, dim=-1)
        outs.append(torch.matmul(weights, vw[g0:g1]))  # (G, ..., n, D_v)
        if need_lse:
            lses.append(_lse(scores, weights))  # (G, ..., n, 1)
    out = torch.cat(outs).movedim(0, -3).flatten(-3, -2)[..., :R, :]  # (..., R, D_v)
    out = F.pad(out, (0, 0, i0, L_q - i1))  # (..., L_q, D_v)
    lse = None
    if need_lse:
        lse = torch.cat(lses).movedim(0, -3).flatten(-3, -2)[..., :R, :]  # (..., R, 1)
        lse = F.pad(lse, (0, 0, i0, L_q - i1), value=float("-inf"))  # (..., L_q, 1)
    return Partial(out=out, lse=lse)


def _fused_tiles(q: Tensor, k: Tensor, v: Tensor, i0: int, i1: int, n: int, m: int,
                 start: int, width: int, key_start: int, key_stop: int, scale: float
                 ) -> Tensor:
    """Rows ``i0:i1`` of a band, one fused attention call per block of ``n`` queries.

    Block ``b`` (rows ``i0 + b n ...``) attends the ``m`` keys from position
    ``c0 = start + b n``, masked by one shared ``(n, m)`` band template (row ``r`` sees columns
    ``r .. r + width``) and, in the edge blocks only, by the keys outside
    ``[key_start, key_stop)`` (zero-padded there). torch's fused kernel does matmul, softmax
    and matmul in one call, with the tile in cache. Every row has an allowed key (``i0:i1``
    was chosen so).

    Returns:
        ``(..., L_q, D_v)``, zeros outside rows ``i0:i1``.
    """
    L_q, L_k, R = q.shape[-2], k.shape[-2], i1 - i0
    t = torch.arange(m, device=q.device)
    r = torch.arange(n, device=q.device).unsqueeze(-1)
    band = (t >= r) & (t <= r + width)  # (n, m), True = may attend
    bias = torch.zeros(n, m, dtype=q.dtype, device=q.device).masked_fill_(~band, float("-inf"))
    outs = []
    for r0 in range(0, R, n):
        rows = min(n, R - r0)
        c0 = start + r0  # key position of the window's first column
        allowed = bias[:rows]  # additive: the fused kernel takes it as it is
        if key_start <= c0 and c0 + m <= key_stop:  # interior: a plain slice of the keys
            kb, vb = k[..., c0:c0 + m, :], v[..., c0:c0 + m, :]  # (..., m, D), (..., m, D_v)
        else:  # edge: zero-pad the missing keys and mask everything outside the key range
            a, b = max(c0, 0), min(c0 + m, L_k)
            pad = (0, 0, a - c0, c0 + m - b)
            kb, vb = F.pad(k[..., a:b, :], pad), F.pad(v[..., a:b, :], pad)
            cols = c0 + t  # (m,)
            allowed = allowed.masked_fill((cols < key_start) | (cols >= key_stop), float("-inf"))
        outs.append(F.scaled_dot_product_attention(
            q[..., i0 + r0:i0 + r0 + rows, :], kb, vb, attn_mask=allowed,
            scale=scale))  # (..., rows, D_v)
    out = torch.cat(outs, dim=-2)  # (..., R, D_v)
    return F.pad(out, (0, 0, i0, L_q - i1)) if (i0, i1) != (0, L_q) else out


def _band_template(n: int, m: int, shift: int, lo: int | None, hi: int | None,
                   device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """``(blocked, empty)`` for a tile whose entry ``(0, 0)`` has ``j - p = shift``.

    ``blocked`` is the bool ``(n, m)`` complement of the band (None when the whole tile is
    inside it); ``empty`` the ``(n, 1)`` rows with no key in the band (None if none).
    """
    lo_in = lo is None or shift - (n - 1) >= lo  # smallest j - p in the tile
    hi_in = hi is None or shift + (m - 1) <= hi  # largest j - p in the tile
    if lo_in and hi_in:
        return None, None  # the whole tile is inside the band
    rel = torch.arange(m, device=device) - torch.arange(n, device=device).unsqueeze(-1) + shift
    # rel: (n, m), j - p of every entry
    blocked = torch.zeros(n, m, dtype=torch.bool, device=device)
    if not lo_in:
        blocked |= rel < lo
    if not hi_in:
        blocked |= rel > hi
    empty = blocked.all(dim=-1, keepdim=True)  # (n, 1)
    # bool() reads data: inside torch.compile keep the (maybe all-False) rows instead.
    keep = torch.compiler.is_compiling() or bool(empty.any())
    return blocked, (empty if keep else None)


def merge_partials(parts: list[Partial]) -> Partial:
    """Combine partials over disjoint key sets into one softmax.

    ``out = sum_p exp(lse_p - lse) * out_p`` with ``lse = log sum_p exp(lse_p)``; rows empty in
    every partial stay zero, without NaN in the output or the gradients.
    """
    lses = torch.stack([p.lse for p in parts])  # (P, ..., L_q, 1)
    top = lses.amax(dim=0).detach()  # (..., L_q, 1), only for stability
    empty = torch.isneginf(top)
    top = top.masked_fill(empty, 0.0)
    total = torch.exp(lses - top).sum(dim=0)  # (..., L_q, 1)
    lse = top + torch.log(total.masked_fill(empty, 1.0))  # finite everywhere
    out, weights = None, None
    for part in parts:
        factor = torch.exp(part.lse - lse)  # (..., L_q, 1); 0 for empty parts
        term = part.out * factor
        out = term if out is None else out + term
        if part.weights is not None:
            wterm = part.weights * factor
            weights = wterm if weights is None else weights + wterm
    return Partial(out=out, lse=lse.masked_fill(empty, float("-inf")), weights=weights)
