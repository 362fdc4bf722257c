"""Caches that hold every key and value so far: :class:`KVCache` (grows) and
:class:`StaticKVCache` (a fixed capacity, for ``torch.compile``).

Both attend from the new queries to the held keys through :func:`grouped_step` when they can:
the usual decoding step of full attention, one new token read against the held keys grouped
by key/value head. The overview of the caches is in :mod:`handformer.attention.cache`.

Shape letters: ``B`` batch, ``H`` heads (``H_kv`` key/value heads), ``L`` length (``L_new`` new
tokens, ``L_k`` keys held), ``D`` head dim, ``D_v`` value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.attention.cache_base import LayerCache, _check_step, _join_keep, _new_key_mask
from handformer.attention.kinds import AttentionKind, FullAttention, attend_kind
from handformer.checks import check_positive_int, check_window_size

__all__ = ["KVCache", "StaticKVCache", "grouped_step"]


def _check_capacity(capacity: object) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer (tokens), got {capacity!r}")
    return check_positive_int("capacity", capacity)  # at most MAX_INT


def grouped_step(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None,
                 scale: float | None) -> Tensor:
    """Fused attention of one new token per sequence over held keys, grouped-query aware.

    ``q: (B, H, 1, D)``, ``k: (B, H_kv, L_k, D)``, ``v: (B, H_kv, L_k, D_v)``: torch's kernel
    reads key/value head ``h // (H / H_kv)`` for query head ``h`` itself (``enable_gqa``), with
    no copy of the keys. (Folding each group's query heads into ``G`` queries of one problem,
    ``(B, H_kv, G, D)``, gives the same numbers but was 0.5-1 ms a step slower on a 30-layer
    model with two threads: the kernel splits its work by heads, and there are fewer.)
    ``key_mask`` broadcasts to ``(B, 1, 1, L_k)``.

    On CPU, float16/bfloat16 inputs are attended in float32 and the result cast back: torch's
    CPU kernel takes ~7x longer for one bfloat16 query than for float32 ones (measured, 9
    query and 3 key/value heads of 64, 1 thread: 0.39 ms against 0.05 over 128 keys, 2.9
    against 0.36 over 1,024), and converting the held keys and values costs less than the
    difference (0.08 and 0.47 ms in all, conversion included).

    Returns:
        ``(B, H, 1, D_v)``.
    """
    gqa = k.shape[1] != q.shape[1]
    if q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cpu":
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=key_mask,
                                              scale=scale, enable_gqa=gqa).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale,
                                          enable_gqa=gqa)


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
