"""Caches whose memory does not grow with the length: :class:`WindowKVCache` (a rolling
window of keys, local attention) and :class:`LinearStateCache` (running sums, linear
attention). The overview of the caches is in :mod:`handformer.attention.cache`.

Shape letters: ``B`` batch, ``H`` heads (``H_kv`` key/value heads), ``L`` length (``L_new`` new
tokens, ``L_k`` keys held), ``D`` head dim, ``D_v`` value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from handformer.attention.cache_base import LayerCache, _check_step, _join_keep, _new_key_mask
from handformer.attention.functional import kv_groups, repeat_kv
from handformer.attention.kinds import AttentionKind, attend_kind
from handformer.attention.linear import LinearAttentionState
from handformer.checks import check_window_size

__all__ = ["WindowKVCache", "LinearStateCache"]


class WindowKVCache(LayerCache):
    """A rolling window of the last ``window_size // 2`` keys (local attention).

    A causal local query at position ``p`` reaches keys ``p - window_size // 2 .. p``, so
    after each call only the last ``window_size // 2`` keys can still matter: the cache never
    holds more (and never more than ``window_size``), whatever the length.

    Args:
        window_size: the local attention's window (odd, >= 1).
    """

    def __init__(self, window_size: int) -> None:
        super().__init__()
        self.window_size = check_window_size(window_size)
        self.keep_last = window_size // 2
        self._k: Tensor | None = None  # (B, H, <= keep_last, D)
        self._v: Tensor | None = None  # (B, H, <= keep_last, D_v)
        self._keep: Tensor | None = None  # (B, <= keep_last) bool
        # push()'s ring (one new token a step): keep_last + 1 slots, filled in place; the
        # oldest key sits at slot _slot once all are filled (None: _k/_v hold the window)
        self._ring: tuple[Tensor, Tensor] | None = None  # (B, H, keep_last + 1, D), (.., D_v)
        self._slot = self._filled = 0

    @property
    def num_keys(self) -> int:
        if self._ring is not None:
            return min(self._filled, self.keep_last)
        return 0 if self._k is None else self._k.shape[2]

    def nbytes(self) -> int:
        held = [t for t in (self._k, self._v, self._keep, *(self._ring or ())) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def _unroll(self) -> None:
        """Put the ring's window back into ``_k``/``_v``, oldest key first (what
        :meth:`attend` and a multi-token :meth:`push` read)."""
        if self._ring is None:
            return
        ring_k, ring_v = self._ring
        if self._filled < ring_k.shape[2]:  # not yet wrapped: slots 0.. in order
            self._k, self._v = (t[:, :, :self._filled].clone() for t in (ring_k, ring_v))
        else:  # slot _slot is the oldest, out of the window: the rest, oldest first
            after = self._slot + 1
            self._k, self._v = (torch.cat([t[:, :, after:], t[:, :, :self._slot]], dim=2)
                                for t in (ring_k, ring_v))  # (B, H, keep_last, D)
        self._ring = None

    def attend(self, attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor, *,
               causal: bool = True, mask: Tensor | None = None, need_weights: bool = False,
               dropout_p: float = 0.0, scale: float | None = None
               ) -> tuple[Tensor, Tensor | None]:
        _check_step(q, k, v, causal)
        self._unroll()
        B, _, L_new, _ = q.shape
        n_old = self.num_keys
        keep_new = _new_key_mask(mask, B, L_new)
        keep_all = _join_keep(self._keep, n_old, keep_new, B, L_new, q.device)
        k_all = k if self._k is None else torch.cat([self._k, k], dim=2)  # (B, H, L_k, D)
        v_all = v if self._v is None else torch.cat([self._v, v], dim=2)  # (B, H, L_k, D_v)
        key_mask = None if keep_all is None else keep_all[:, None, None, :]  # (B, 1, 1, L_k)
        # Positions are relative: the held keys are the ones just before the new tokens, and
        # the window only looks at differences p - j, so bottom-right alignment is exact.
        out = attend_kind(attention, q, k_all, v_all, key_mask, causal=L_new > 1,
                          need_weights=need_weights, dropout_p=dropout_p, scale=scale)
        start = k_all.shape[2] - min(self.keep_last, k_all.shape[2])
        # .clone() so the window does not keep the whole prompt's storage alive.
        self._k = k_all[:, :, start:].clone()  # (B, H, <= keep_last, D)
        self._v = v_all[:, :, start:].clone()  # (B, H, <= keep_last, D_v)
        self._keep = None if keep_all is None else keep_all[:, start:].clone()
        self.seen += L_new
        return out

    def push(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Add the keys and values of real new tokens, with no checks (a trusted caller).

        What :class:`~handformer.models.plain_step.PlainDecodeStep` calls for each new token
        of a sliding-window layer: the held window plus the new keys (every one of them
        within the window of a single new query), then the window rolls on.

        Args:
            k: ``(B, H, L_new, D)`` keys of real tokens (no padding among them).
            v: ``(B, H, L_new, D_v)`` their values.

        Returns:
            ``(keys, values, key_mask)``: ``(B, H, L_k, D)``, ``(B, H, L_k, D_v)`` and the
            ``(B, 1, 1, L_k)`` bool key mask (None when no padding is held). For one new
            token and no padding, views of a ring of ``keep_last + 1`` slots written in place
            (no copy of the window a step): once it wraps, the keys come in rotated order,
            which one query's attention does not see (the positions are in the rotated keys).
            They are valid until the next call.
        """
        B, _, L_new, _ = k.shape
        if L_new == 1 and self._keep is None and (self._ring is not None or self._k is not None):
            return self._push_one(k, v)
        self._unroll()
        keep_all = (None if self._keep is None
                    else _join_keep(self._keep, self.num_keys, None, B, L_new, k.device))
        k_all = k if self._k is None else torch.cat([self._k, k], dim=2)  # (B, H, L_k, D)
        v_all = v if self._v is None else torch.cat([self._v, v], dim=2)  # (B, H, L_k, D_v)
        start = k_all.shape[2] - min(self.keep_last, k_all.shape[2])
        # views of a window-sized tensor (no clone needed: it holds nothing more)
        self._k, self._v = k_all[:, :, start:], v_all[:, :, start:]
        self._keep = None if keep_all is None else keep_all[:, start:]
        self.seen += L_new
        return k_all, v_all, None if keep_all is None else keep_all[:, None, None, :]

    def _push_one(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, None]:
        """:meth:`push` of one token into the ring (made from the window on first use)."""
        if self._ring is None:
            held = self._k.shape[2]  # (B, H, held, D): oldest first
            self._ring = tuple(t.new_empty(*t.shape[:2], self.keep_last + 1, t.shape[3])
                               for t in (self._k, self._v))  # type: ignore[assignment]
            for ring, t in zip(self._ring, (self._k, self._v), strict=True):
                ring[:, :, :held] = t
            self._slot, self._filled, self._k, self._v = held, held, None, None
        ring_k, ring_v = self._ring
        ring_k[:, :, self._slot] = k[:, :, 0]  # over the oldest key, out of the window now
        ring_v[:, :, self._slot] = v[:, :, 0]
        self._filled = min(self._filled + 1, ring_k.shape[2])
        self._slot = (self._slot + 1) % ring_k.shape[2]
        self.seen += 1
        return ring_k[:, :, :self._filled], ring_v[:, :, :self._filled], None


class LinearStateCache(LayerCache):
    """The running state of causal linear attention: constant size.

    ``out_i = phi(q_i) . (S + sum_{j<=i} phi(k_j) v_j^T) / (phi(q_i) . (z + sum_{j<=i} phi(k_j))
    + eps)``, with ``S = sum phi(k) v^T`` and ``z = sum phi(k)`` over all earlier tokens,
    computed by the kind's recurrent :meth:`~handformer.attention.linear.LinearAttention.step`.
    Padded keys (mask False) are left out of the sums. The state is kept in float32.

    The token count is a tensor (as :class:`StaticKVCache`'s slot): the state has one shape
    whatever the length, so a compiled decoding step serves every step.
    """

    def __init__(self) -> None:  # no super().__init__(): ``seen`` is derived
        self.S: Tensor | None = None  # (B, H, D, D_v) float32
        self.z: Tensor | None = None  # (B, H, D) float32
        self._count: Tensor | None = None  # () long: tokens fed so far

    @property
    def seen(self) -> int:
        """Tokens fed so far, read from the count tensor (never inside a compiled graph)."""
        return 0 if self._count is None else int(self._count)

    @property
    def num_keys(self) -> int:
        return 0

    def nbytes(self) -> int:
        held = [t for t in (self.S, self.z) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def attend(self, attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor, *,
               causal: bool = True, mask: Tensor | None = None, need_weights: bool = False,
               dropout_p: float = 0.0, scale: float | None = None
               ) -> tuple[Tensor, Tensor | None]:
        _check_step(q, k, v, causal)
        if need_weights:
            raise ValueError(
                "need_weights=True with a linear-attention cache: the state S = sum phi(k) v^T "
                "has no per-key weights; run without the cache to get attention maps"
            )
        B, _, L_new, _ = q.shape
        keep_new = _new_key_mask(mask, B, L_new)
        key_mask = None if keep_new is None else keep_new[:, None, None, :]  # (B, 1, 1, L_new)
        # Cache masks are boolean, so the state never holds a float-bias maximum here.
        state = None if self.S is None else LinearAttentionState(kv=self.S, k_sum=self.z)
        groups = kv_groups(q, k)  # the state is per query head
        out, state = attention.step(q, repeat_kv(k, groups), repeat_kv(v, groups), state,
                                    mask=key_mask, scale=scale)
        self.S, self.z = state.kv, state.k_sum  # (B, H, D, D_v), (B, H, D)
        if self._count is None:
            self._count = torch.zeros((), dtype=torch.long, device=q.device)
        self._count += L_new
        return out, None
