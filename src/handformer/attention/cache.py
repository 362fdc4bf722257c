"""Incremental decoding: one cache interface for every attention kind.

A decoder that generates token by token would recompute every earlier key and value at each
step. A cache keeps what later steps need instead, and every attention kind keeps something
different:

* :class:`KVCache` (full and strided attention): all keys and values so far, in a buffer
  written in place, allocated for ``capacity`` tokens when that is known (``generate`` knows
  it: prompt plus new tokens) and otherwise grown by doubling. Strided attention keeps every
  key too (its pattern reaches back to any multiple of the stride); the pattern is applied by
  the kind itself, on the cached keys, thanks to the bottom-right alignment of ``causal``.
* :class:`StaticKVCache` (full attention under ``torch.compile``): the same keys and values
  in buffers of a fixed capacity, attended in full with a key mask (slots not written yet
  are masked), so that every decoding step has the same shapes and one compiled graph
  serves them all.
* :class:`WindowKVCache` (local attention): a rolling window of the last
  ``window_size // 2`` keys (what a causal query can still reach). Memory is bounded, it does
  not grow with the length.
* :class:`LinearStateCache` (linear attention): the running sums ``S = sum phi(k) v^T``
  ``(B, H, D, D_v)`` and ``z = sum phi(k)`` ``(B, H, D)``: constant size, whatever the length.

How it is used: a model creates one cache per attention layer (``CausalLM.new_cache()``
returns a :class:`DecodingCache` holding them) and passes each layer its own with
``MultiHeadAttention.forward(x, causal=True, cache=layer_cache, mask=key_mask)``. The layer
projects the new tokens to ``q, k, v`` and calls ``layer_cache.attend(kind, q, k, v, ...)``,
which adds the new keys to the cache and attends from the new queries to everything the
cache holds. Feeding a sequence in one call or in pieces gives the same outputs.

With a cache, ``mask`` is a boolean key mask for the *new* tokens only (``(B, 1, 1, L_new)``,
True = real token, e.g. False on left padding); the cache remembers the masks of earlier
tokens. Decoding is causal: ``causal=True`` is required.

A single new token (the usual decoding step) sits at the last position and every held key is
at or before it, so the kind is then called with ``causal=False``: same result, fewer ops.

Grouped-query attention: the caches hold the keys and values as the layer made them,
``H_kv`` heads (fewer than the ``H`` query heads), so their memory is ``H_kv / H`` of
multi-head attention's. They are expanded to the query heads only where a kernel needs it:
the decoding step of full attention reads them grouped, the queries reshaped to
``(B, H_kv, G, D)`` (``G = H / H_kv`` queries per key head) against the held
``(B, H_kv, L_k, D)``, with no copy; full attention over several new tokens passes
``enable_gqa=True`` to torch's kernel; the other kinds get repeated keys and values.

Shape letters: ``B`` batch, ``H`` heads (``H_kv`` key/value heads), ``L`` length (``L_new`` new
tokens, ``L_k`` keys held), ``D`` head dim, ``D_v`` value dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.attention.functional import kv_groups, repeat_kv
from handformer.attention.kinds import AttentionKind, FullAttention, attend_kind
from handformer.attention.linear import LinearAttention, LinearAttentionState
from handformer.attention.local import LocalAttention
from handformer.checks import check_positive_int, check_window_size
from handformer.masks import check_mask

__all__ = [
    "LayerCache",
    "KVCache",
    "StaticKVCache",
    "WindowKVCache",
    "LinearStateCache",
    "DecodingCache",
    "cache_for",
    "grouped_step",
]


def _new_key_mask(mask: Tensor | None, B: int, L_new: int) -> Tensor | None:
    """Validate a cache-mode key mask and return it as ``(B, L_new)`` bool (or None)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            "with a cache, mask must be a boolean key mask (B, 1, 1, L_new) with True = real "
            f"token; got {type(mask).__name__}"
            + (f" of dtype {mask.dtype}" if isinstance(mask, Tensor) else "")
        )
    check_mask(mask, (B, 1, 1, L_new))
    return mask.expand(B, 1, 1, L_new).reshape(B, L_new)  # (B, 1, 1, L_new) -> (B, L_new)


def _check_step(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if not causal:
        raise ValueError(
            "a decoding cache needs causal=True: earlier tokens cannot attend to later ones "
            "that were not there yet"
        )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"cache.attend expects (B, H, L, D) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"with a cache, queries and new keys come from the same tokens: q has "
            f"{q.shape[2]}, k has {k.shape[2]}"
        )
    kv_groups(q, k)  # the key/value heads divide the query heads


def _check_capacity(capacity: object) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer (tokens), got {capacity!r}")
    return check_positive_int("capacity", capacity)  # at most MAX_INT


def _join_keep(old: Tensor | None, n_old: int, new: Tensor | None, B: int, L_new: int,
               device: torch.device) -> Tensor | None:
    """Concatenate two optional ``(B, L)`` key masks (None = all real)."""
    if old is None and new is None:
        return None
    if old is None:
        old = torch.ones(B, n_old, dtype=torch.bool, device=device)
    if new is None:
        new = torch.ones(B, L_new, dtype=torch.bool, device=device)
    return torch.cat([old, new], dim=1)  # (B, n_old + L_new)


def grouped_step(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None,
                 scale: float | None) -> Tensor:
    """Fused attention of one new token per sequence over held keys, read grouped.

    ``q: (B, H, 1, D)``, ``k: (B, H_kv, L_k, D)``, ``v: (B, H_kv, L_k, D_v)``: the ``G``
    query heads of a key head become ``G`` queries of one problem (a view, no copy of the
    keys), ``(B, H_kv, G, D)``. ``key_mask`` broadcasts to ``(B, 1, 1, L_k)``.

    Returns:
        ``(B, H, 1, D_v)``.
    """
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    if H_kv == H:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale)
    grouped = q.reshape(B, H_kv, H // H_kv, D)  # (B, H, 1, D) -> (B, H_kv, G, D)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=key_mask, scale=scale)
    return out.reshape(B, H, 1, v.shape[-1])  # (B, H_kv, G, D_v) -> (B, H, 1, D_v)


def _attend_held(attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor,
                 key_mask: Tensor | None, new_tokens_real: bool, *, causal: bool,
                 need_weights: bool, dropout_p: float, scale: float | None
                 ) -> tuple[Tensor, Tensor | None]:
    """Attend from the new queries to the held keys with the layer's kind.

    The usual decoding step of full attention (one real new token, no weights, no dropout,
    no soft-cap) goes straight to torch's fused kernel (:func:`grouped_step`): its inputs
    come from the layer (shapes already right) and the token's own key is always allowed,
    so neither the kind's argument checks nor its guard for rows without any allowed key
    are needed. Same numbers.
    """
    if (type(attention) is FullAttention and attention.softcap is None and q.shape[-2] == 1
            and new_tokens_real and not need_weights and dropout_p == 0.0):
        return grouped_step(q, k, v, key_mask, scale), None
    return attend_kind(attention, q, k, v, key_mask, causal=causal, need_weights=need_weights,
                       dropout_p=dropout_p, scale=scale)


class LayerCache:
    """One attention layer's decoding state (base class).

    Attributes:
        seen: number of tokens (padding included) this cache has been fed.
    """

    def __init__(self) -> None:
        self.seen = 0

    def attend(self, attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor, *,
               causal: bool = True, mask: Tensor | None = None, need_weights: bool = False,
               dropout_p: float = 0.0, scale: float | None = None
               ) -> tuple[Tensor, Tensor | None]:
        """Add the new ``k, v`` to the cache, attend from ``q`` to everything held.

        Args:
            attention: the layer's attention kind.
            q: ``(B, H, L_new, D)`` queries of the new tokens.
            k: ``(B, H, L_new, D)`` their keys.
            v: ``(B, H, L_new, D_v)`` their values.
            causal: must be True.
            mask: bool key mask of the new tokens, broadcastable to ``(B, 1, 1, L_new)``.
            need_weights: also return the weights over the held keys ``(B, H, L_new, L_k)``.
            dropout_p: dropout on the attention weights.
            scale: the kind's score scale (None = its default), passed on to it.

        Returns:
            ``(out, weights)``: ``out`` is ``(B, H, L_new, D_v)``.

        Raises:
            ValueError: without ``causal``, for shapes that do not fit the cache.
            TypeError: for a mask that is not boolean.
        """
        raise NotImplementedError

    @property
    def num_keys(self) -> int:
        """Number of keys the cache holds now."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of tensor memory the cache holds (capacity, not just the used part)."""
        raise NotImplementedError


class KVCache(LayerCache):
    """Every key and value so far (full and strided attention); grows with the length.

    The buffers are written in place. They are allocated for ``capacity`` tokens at the first
    call when it is given (no copy ever after, as long as it suffices); otherwise, and past
    it, storage doubles when full, so appending one token costs O(1) amortised copies.

    Args:
        capacity: tokens to allocate room for at the first call (None: start small, double).

    Raises:
        ValueError: for a ``capacity`` that is not a positive integer.
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        self.capacity = None if capacity is None else _check_capacity(capacity)
        self._k: Tensor | None = None  # (B, H, capacity, D)
        self._v: Tensor | None = None  # (B, H, capacity, D_v)
        self._keep: Tensor | None = None  # (B, n) bool, None = no padding so far
        self._n = 0

    @property
    def num_keys(self) -> int:
        return self._n

    def nbytes(self) -> int:
        held = [t for t in (self._k, self._v, self._keep) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def keys_values(self) -> tuple[Tensor, Tensor] | tuple[None, None]:
        """The held ``(B, H, L_k, D)`` keys and ``(B, H, L_k, D_v)`` values (views)."""
        if self._k is None:
            return None, None
        return self._k[:, :, :self._n], self._v[:, :, :self._n]

    def _append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H, L_new, D = k.shape
        n = self._n + L_new
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # Differentiable path (training through a cache): plain concatenation.
            old_k, old_v = self.keys_values()
            self._k = k if old_k is None else torch.cat([old_k, k], dim=2)  # (B, H, n, D)
            self._v = v if old_v is None else torch.cat([old_v, v], dim=2)  # (B, H, n, D_v)
        else:
            if self._k is None or n > self._k.shape[2] or self._k.shape[:2] != (B, H):
                if self._k is not None and self._k.shape[:2] != (B, H):
                    raise ValueError(
                        f"the cache holds batch/heads {tuple(self._k.shape[:2])}, got new keys "
                        f"{tuple(k.shape)}"
                    )
                first = self._k is None and self.capacity is not None and n <= self.capacity
                capacity = self.capacity if first else max(2 * n, 16)
                new_k = k.new_empty(B, H, capacity, D)  # (B, H, capacity, D)
                new_v = v.new_empty(B, H, capacity, v.shape[-1])  # (B, H, capacity, D_v)
                if self._n:
                    new_k[:, :, :self._n] = self._k[:, :, :self._n]
                    new_v[:, :, :self._n] = self._v[:, :, :self._n]
                self._k, self._v = new_k, new_v
            self._k.narrow(2, self._n, L_new).copy_(k)  # in place: (B, H, L_new, D)
            self._v.narrow(2, self._n, L_new).copy_(v)
        self._n = n
        return self.keys_values()

    def push(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Add the keys and values of real new tokens, with no checks (a trusted caller).

        What :class:`~handformer.models.plain_step.PlainDecodeStep` calls for each new token:
        :meth:`attend` without the argument checks and without the attention itself.

        Args:
            k: ``(B, H, L_new, D)`` keys of real tokens (no padding among them).
            v: ``(B, H, L_new, D_v)`` their values.

        Returns:
            ``(keys, values, key_mask)``: everything held, ``(B, H, L_k, D)`` and
            ``(B, H, L_k, D_v)`` (views of the buffers), and the ``(B, 1, 1, L_k)`` bool key
            mask (None when no padding was ever fed).
        """
        B, _, L_new, _ = k.shape
        if self._keep is not None:
            self._keep = _join_keep(self._keep, self._n, None, B, L_new, k.device)
        keys, values = self._append(k, v)
        self.seen += L_new
        return keys, values, None if self._keep is None else self._keep[:, None, None, :]

    def attend(self, attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor, *,
               causal: bool = True, mask: Tensor | None = None, need_weights: bool = False,
               dropout_p: float = 0.0, scale: float | None = None
               ) -> tuple[Tensor, Tensor | None]:
        _check_step(q, k, v, causal)
        B, _, L_new, _ = q.shape
        keep_new = _new_key_mask(mask, B, L_new)
        self._keep = _join_keep(self._keep, self._n, keep_new, B, L_new, q.device)
        k_all, v_all = self._append(k, v)  # (B, H, L_k, D), (B, H, L_k, D_v)
        self.seen += L_new
        key_mask = None if self._keep is None else self._keep[:, None, None, :]
        # key_mask: (B, 1, 1, L_k); causal is bottom-right, so the new queries sit last.
        return _attend_held(attention, q, k_all, v_all, key_mask, keep_new is None,
                            causal=L_new > 1, need_weights=need_weights, dropout_p=dropout_p,
                            scale=scale)


class StaticKVCache(LayerCache):
    """Keys and values in buffers of a fixed ``capacity``, attended in full with a key mask.

    What ``torch.compile`` needs for decoding (``generate(..., compile=True)``): every call
    with one new token has the same shapes, whatever the length so far, so one compiled graph
    serves every step. The new keys are written in place at the next free slots (a position
    held in a tensor, not a Python number the graph would depend on); the queries attend
    over the whole buffer with the mask ``filled[j] and j <= slot of the query``, which
    hides the slots not written yet and is the causal pattern within the new tokens. The
    numbers equal :class:`KVCache`'s (masked keys get weight exactly 0), up to rounding.

    Only for attention kinds that attend to every allowed key (full attention): a kind with
    its own pattern (local, strided) places it relative to the last key, which here is the
    end of the buffer. A causal sliding-window layer (``LocalAttention(w, causal=True)``) is
    served by ``window_size=w``: its window goes into the key mask (``slot of the query -
    w // 2 <= j``) and the attention is full attention with the layer's soft-cap, the same
    numbers as the rolling window (it holds every token, not just the window).

    Args:
        capacity: the most tokens the cache will hold (prompt plus new tokens).
        window_size: a causal sliding window (odd) to apply through the key mask; None:
            none.
        softcap: the sliding-window layer's soft-cap (only with ``window_size``).

    Raises:
        ValueError: for a ``capacity`` that is not a positive integer; when more tokens
            than ``capacity`` are fed.
    """

    def __init__(self, capacity: int, *, window_size: int | None = None,
                 softcap: float | None = None) -> None:  # no super().__init__(): see seen
        self.capacity = _check_capacity(capacity)
        self.window_size = None if window_size is None else check_window_size(window_size)
        self._window_kind = None if window_size is None else FullAttention(softcap=softcap)
        self._k: Tensor | None = None  # (B, H, capacity, D)
        self._v: Tensor | None = None  # (B, H, capacity, D_v)
        self._filled: Tensor | None = None  # (B, capacity) bool: a real token in this slot
        self._slot: Tensor | None = None  # (1,) long: the next free slot
        self._key_pos: Tensor | None = None  # (capacity,) long: 0 .. capacity - 1

    @property
    def seen(self) -> int:
        """Tokens fed so far, read from the slot tensor (never inside a compiled graph)."""
        return 0 if self._slot is None else int(self._slot)

    @property
    def num_keys(self) -> int:
        return self.seen

    def nbytes(self) -> int:
        held = [t for t in (self._k, self._v, self._filled, self._slot, self._key_pos)
                if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def _allocate(self, k: Tensor, v: Tensor) -> None:
        B, H, _, D = k.shape
        self._k = k.new_zeros(B, H, self.capacity, D)  # (B, H, capacity, D)
        self._v = v.new_zeros(B, H, self.capacity, v.shape[-1])  # (B, H, capacity, D_v)
        self._filled = torch.zeros(B, self.capacity, dtype=torch.bool, device=k.device)
        self._slot = torch.zeros(1, dtype=torch.long, device=k.device)
        self._key_pos = torch.arange(self.capacity, device=k.device)  # (capacity,)

    def attend(self, attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor, *,
               causal: bool = True, mask: Tensor | None = None, need_weights: bool = False,
               dropout_p: float = 0.0, scale: float | None = None
               ) -> tuple[Tensor, Tensor | None]:
        _check_step(q, k, v, causal)
        B, _, L_new, _ = q.shape
        # (Inside torch.compile the caller sized the cache: reading the slot would break the
        # graph.)
        if not torch.compiler.is_compiling() and self.seen + L_new > self.capacity:
            raise ValueError(f"the static cache holds {self.capacity} tokens: {self.seen} "
                             f"cached + {L_new} new do not fit")
        if self._k is None:
            self._allocate(k, v)
        keep_new = _new_key_mask(mask, B, L_new)
        slots = self._slot + torch.arange(L_new, device=q.device)  # (L_new,)
        self._k.index_copy_(2, slots, k)  # in place, at the next free slots
        self._v.index_copy_(2, slots, v)
        self._filled.index_fill_(1, slots, True)
        if keep_new is not None:
            self._filled.index_copy_(1, slots, keep_new)
        # (B, 1, L_new, capacity): a written, real key at or before the query's own slot.
        reach = self._key_pos <= slots[:, None]  # (L_new, capacity)
        if self.window_size is not None:  # ... and within the sliding window
            reach = reach & (self._key_pos >= slots[:, None] - self.window_size // 2)
            attention = self._window_kind
        key_mask = self._filled[:, None, None, :] & reach[None, None]
        self._slot += L_new
        return _attend_held(attention, q, self._k, self._v, key_mask, keep_new is None,
                            causal=False, need_weights=need_weights, dropout_p=dropout_p,
                            scale=scale)


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

    @property
    def num_keys(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def nbytes(self) -> int:
        held = [t for t in (self._k, self._v, self._keep) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def attend(self, attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor, *,
               causal: bool = True, mask: Tensor | None = None, need_weights: bool = False,
               dropout_p: float = 0.0, scale: float | None = None
               ) -> tuple[Tensor, Tensor | None]:
        _check_step(q, k, v, causal)
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
            ``(B, 1, 1, L_k)`` bool key mask (None when no padding is held).
        """
        B, _, L_new, _ = k.shape
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


def cache_for(attention: AttentionKind, *, capacity: int | None = None,
              static: bool = False) -> LayerCache:
    """The cache an attention kind needs for decoding.

    A kind with a ``new_cache(capacity=..., static=...)`` method makes its own
    (:class:`~handformer.attention.sinks.SinkAttention`). Local attention gets a
    :class:`WindowKVCache` (with ``static=True``, a causal local kind a
    :class:`StaticKVCache` with its window), linear attention a
    :class:`LinearStateCache` (both of a fixed size already), full attention a
    :class:`KVCache` (a :class:`StaticKVCache` with ``static=True``), every other kind
    (strided, ...) a :class:`KVCache`.

    Args:
        attention: the layer's attention kind.
        capacity: tokens a KV cache allocates room for up front (None: it grows).
        static: full attention gets a :class:`StaticKVCache` of ``capacity`` tokens (for
            ``torch.compile``).

    Raises:
        TypeError: if ``attention`` is not an attention kind.
        ValueError: for ``static=True`` without a ``capacity``.
    """
    if not isinstance(attention, AttentionKind):
        raise TypeError(f"attention must be an attention kind, got {type(attention).__name__}")
    if static and capacity is None:
        raise ValueError("static=True needs a capacity (the most tokens the cache will hold)")
    make = getattr(attention, "new_cache", None)
    if callable(make):  # a kind that knows its own cache (SinkAttention)
        return make(capacity=capacity, static=static)
    if isinstance(attention, LocalAttention):
        if static and attention.causal:  # a decoder's sliding-window layer, compiled
            return StaticKVCache(capacity, window_size=attention.window_size,
                                 softcap=attention.softcap)
        return WindowKVCache(attention.window_size)
    if isinstance(attention, LinearAttention):
        return LinearStateCache()
    if static and type(attention) is FullAttention:
        return StaticKVCache(capacity)
    return KVCache(capacity)


@dataclass
class DecodingCache:
    """A whole model's decoding state: one :class:`LayerCache` per attention layer.

    Created by ``CausalLM.new_cache()`` and passed to ``model(ids, cache=cache)`` again and
    again; the model feeds ``cache.layers[i]`` to layer ``i`` and advances ``seen`` and
    ``next_positions``.

    Attributes:
        layers: the per-layer caches.
        seen: tokens fed so far (padding included), the same for every sequence.
        next_positions: ``(B,)`` position of each sequence's next real token (left padding
            does not count), or None before the first call.
    """

    layers: list[LayerCache]
    seen: int = 0
    next_positions: Tensor | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        """Bytes held by all layer caches."""
        return sum(c.nbytes() for c in self.layers)
