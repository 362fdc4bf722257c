"""Attention sinks: a sliding window that also keeps the first keys (StreamingLLM).

Xiao et al. 2023 ("Efficient Streaming Language Models with Attention Sinks") found that
language models put a large share of their attention on the first few tokens whatever they
hold, and that a plain sliding window, which drops those keys once the text is longer than
the window, ruins perplexity; keeping the first ``sink_tokens`` keys beside the window (4 in
the paper) restores it. Pattern (positions aligned bottom-right: query ``i`` sits at key
position ``p = i + L_k - L_q``): query ``i`` may attend key ``j`` iff

    |p - j| <= window_size // 2   or   j < sink_tokens

and ``j <= p`` when ``causal``; a ``mask`` restricts it further. Softmax attention with scale
``1/sqrt(D)`` unless ``scale`` is given.

:class:`SinkAttention` is an attention kind (the one call signature; ``need_weights=True``
returns the dense ``(..., L_q, L_k)`` matrix, zero outside the pattern), and
:class:`SinkWindowKVCache` its decoding cache: the sink keys plus a rolling window of the last
``window_size // 2`` keys, so memory stays bounded however long the text; decoding with it
gives what recomputing the whole sequence with the kind gives. Positions are the tokens' own
(RoPE is applied before the cache), so this is the pattern of the paper, not its re-numbering
of positions inside the cache (which lets a model run past its trained context).

With left padding, the sinks are the first key *positions*, padding included: a padded
sequence then has fewer real sinks.

Cost: the kind computes the dense masked scores through torch's fused kernel (time
``O(L_q * L_k * D)``, like full attention; the ``L_q x L_k`` matrix is written only with
``need_weights``); the cache holds at most ``sink_tokens + window_size // 2`` keys.

Grouped-query attention: keys and values may have ``H_kv`` heads (fewer than the queries'),
and the cache holds them so.

Shape letters: ``B`` batch, ``H`` heads (``H_kv`` key/value heads), ``L_q`` queries, ``L_k``
keys, ``D`` head dim, ``D_v`` value dim, leading batch dims ``...``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from handformer.attention.cache_base import LayerCache, _check_step, _join_keep, _new_key_mask
from handformer.attention.functional import check_qkv, kv_groups, scaled_dot_product_attention
from handformer.attention.kinds import AttentionKind, check_no_dropout
from handformer.checks import check_non_negative_int, check_softcap, check_window_size
from handformer.masks import check_mask, window_mask

__all__ = ["sink_mask", "sink_attention", "SinkAttention", "SinkWindowKVCache"]


def sink_mask(L_q: int, L_k: int, window_size: int, sink_tokens: int, *, causal: bool = False,
              device: torch.device | str | None = None) -> Tensor:
    """Dense boolean ``(L_q, L_k)`` pattern: the window plus the first ``sink_tokens`` keys.

    Raises:
        ValueError: for an even or non-positive ``window_size``, a negative ``sink_tokens``.
    """
    check_non_negative_int("sink_tokens", sink_tokens)
    allowed = window_mask(L_q, L_k, window_size, causal=causal, device=device)  # (L_q, L_k)
    j = torch.arange(L_k, device=device)  # (L_k,)
    sinks = (j < sink_tokens).expand(L_q, L_k)  # (L_q, L_k)
    if causal:
        p = torch.arange(L_q, device=device).unsqueeze(-1) + (L_k - L_q)  # (L_q, 1)
        sinks = sinks & (j <= p)
    return allowed | sinks


def sink_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                   window_size: int, sink_tokens: int, causal: bool = False,
                   scale: float | None = None, need_weights: bool = False,
                   softcap: float | None = None, enable_gqa: bool = False
                   ) -> tuple[Tensor, Tensor | None]:
    """Sliding-window attention that also sees the first ``sink_tokens`` keys.

    Args:
        q: queries ``(..., L_q, D)``.
        k: keys ``(..., L_k, D)``.
        v: values ``(..., L_k, D_v)``.
        mask: bool (True = may attend) or float (additive bias) mask broadcastable to
            ``(..., L_q, L_k)``; it restricts the pattern further.
        window_size: odd ``w >= 1`` (keyword-only): ``w // 2`` keys on each side of the query,
            only the left side when causal.
        sink_tokens: how many first keys every query may also see (0: plain local attention).
        causal: also require ``j <= p`` (bottom-right aligned).
        scale: score scale (a positive number); None means ``1 / sqrt(D)``.
        need_weights: also return the dense ``(..., L_q, L_k)`` weights.
        softcap: attention-logit soft-cap ``softcap * tanh(s / softcap)`` (None: none).
        enable_gqa: ``k``/``v`` have fewer heads (dim -3) than ``q`` (grouped-query).

    Returns:
        ``(out, weights)``: ``out`` ``(..., L_q, D_v)``; ``weights`` or None.

    Raises:
        ValueError: for a bad ``window_size`` or ``sink_tokens``, mismatched shapes or a mask
            that does not broadcast.
        TypeError: for non-floating inputs or a mask that is neither bool nor floating.
    """
    check_qkv(q, k, v, enable_gqa=enable_gqa)
    L_q, L_k = q.shape[-2], k.shape[-2]
    allowed = sink_mask(L_q, L_k, window_size, sink_tokens, causal=causal, device=q.device)
    if mask is not None:
        check_mask(mask, (*q.shape[:-2], L_q, L_k))
        allowed = (mask & allowed if mask.dtype == torch.bool
                   else mask.masked_fill(~allowed, float("-inf")))
    return scaled_dot_product_attention(q, k, v, allowed, scale=scale, need_weights=need_weights,
                                        softcap=softcap, enable_gqa=enable_gqa)


class SinkAttention(AttentionKind):
    """StreamingLLM's pattern as an attention kind (see :func:`sink_attention`).

    Args:
        window_size: odd ``w >= 1``; a query sees the keys within ``w // 2`` positions.
        sink_tokens: the first keys every query also sees (the paper keeps 4).
        softcap: attention-logit soft-cap (None: none), as for the other softmax kinds.

    Raises:
        ValueError: for a ``window_size`` that is not an odd positive integer, a
            ``sink_tokens`` that is not a non-negative integer, or a bad ``softcap``.
    """

    supports_dropout = False
    supports_gqa = True

    def __init__(self, window_size: int, *, sink_tokens: int = 4,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.window_size = check_window_size(window_size)
        self.sink_tokens = check_non_negative_int("sink_tokens", sink_tokens)
        self.softcap = check_softcap(softcap)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                scale: float | None = None, enable_gqa: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """See :func:`sink_attention`; ``dropout_p`` must be 0 (ValueError otherwise)."""
        check_no_dropout(self, dropout_p)
        return sink_attention(q, k, v, mask, window_size=self.window_size,
                              sink_tokens=self.sink_tokens, causal=causal, scale=scale,
                              need_weights=need_weights, softcap=self.softcap,
                              enable_gqa=enable_gqa)

    def pattern(self, L_q: int, L_k: int, *, causal: bool = False) -> Tensor:
        """The dense bool ``(L_q, L_k)`` pattern (:func:`sink_mask`)."""
        return sink_mask(L_q, L_k, self.window_size, self.sink_tokens, causal=causal)

    def new_cache(self, *, capacity: int | None = None, static: bool = False) -> LayerCache:
        """The decoding cache of this kind (``capacity`` does not apply: its size is bounded
        by the window).

        Raises:
            ValueError: for ``static=True`` (a fixed-shape cache for ``torch.compile``): the
                held keys change shape until the window is full.
        """
        if static:
            raise ValueError("SinkAttention has no static (fixed-shape) cache for "
                             "torch.compile; generate with compile=False")
        return SinkWindowKVCache(self.window_size, sink_tokens=self.sink_tokens)

    def extra_repr(self) -> str:
        cap = "" if self.softcap is None else f", softcap={self.softcap}"
        return f"window_size={self.window_size}, sink_tokens={self.sink_tokens}{cap}"


class SinkWindowKVCache(LayerCache):
    """The first ``sink_tokens`` keys and a rolling window of the last ``window_size // 2``.

    Each held key remembers its position (tokens fed before it, padding included), so the
    new queries attend with the exact pattern of :class:`SinkAttention` over the held keys,
    which are not contiguous once the text outgrows the window.

    Args:
        window_size: the window (odd, >= 1).
        sink_tokens: the first keys kept for good.
    """

    def __init__(self, window_size: int, *, sink_tokens: int = 4) -> None:
        super().__init__()
        self.window_size = check_window_size(window_size)
        self.sink_tokens = check_non_negative_int("sink_tokens", sink_tokens)
        self.keep_last = window_size // 2
        self._k: Tensor | None = None  # (B, H_kv, n, D)
        self._v: Tensor | None = None  # (B, H_kv, n, D_v)
        self._pos: Tensor | None = None  # (n,) long: each held key's position
        self._keep: Tensor | None = None  # (B, n) bool, None = no padding held

    @property
    def num_keys(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def nbytes(self) -> int:
        held = [t for t in (self._k, self._v, self._pos, self._keep) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def attend(self, attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor, *,
               causal: bool = True, mask: Tensor | None = None, need_weights: bool = False,
               dropout_p: float = 0.0, scale: float | None = None
               ) -> tuple[Tensor, Tensor | None]:
        _check_step(q, k, v, causal)
        check_no_dropout(attention, dropout_p)
        B, _, L_new, _ = q.shape
        keep_new = _new_key_mask(mask, B, L_new)
        keep_all = _join_keep(self._keep, self.num_keys, keep_new, B, L_new, q.device)
        new_pos = self.seen + torch.arange(L_new, device=q.device)  # (L_new,)
        k_all = k if self._k is None else torch.cat([self._k, k], dim=2)  # (B, H_kv, L_k, D)
        v_all = v if self._v is None else torch.cat([self._v, v], dim=2)  # (B, H_kv, L_k, D_v)
        pos = new_pos if self._pos is None else torch.cat([self._pos, new_pos])  # (L_k,)
        # (L_new, L_k): the kind's pattern written with the held keys' own positions.
        back = new_pos[:, None] - pos[None, :]
        allowed = (back >= 0) & ((back <= self.keep_last) | (pos[None, :] < self.sink_tokens))
        allowed = allowed[None, None]  # (1, 1, L_new, L_k)
        if keep_all is not None:
            allowed = allowed & keep_all[:, None, None, :]  # (B, 1, L_new, L_k)
        out = scaled_dot_product_attention(q, k_all, v_all, allowed, scale=scale,
                                           need_weights=need_weights,
                                           softcap=getattr(attention, "softcap", None),
                                           enable_gqa=kv_groups(q, k) > 1)
        end = self.seen + L_new
        held = (pos < self.sink_tokens) | (pos >= end - self.keep_last)  # (L_k,)
        index = held.nonzero().squeeze(1)  # (n,)
        # index_select copies, so the cache does not keep the whole prompt's storage alive.
        self._k = k_all.index_select(2, index)  # (B, H_kv, n, D)
        self._v = v_all.index_select(2, index)  # (B, H_kv, n, D_v)
        self._pos = pos[index]
        self._keep = None if keep_all is None else keep_all[:, index]
        self.seen = end
        return out
