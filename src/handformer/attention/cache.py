"""Incremental decoding: one cache interface for every attention kind.

A decoder that generates token by token would recompute every earlier key and value at each
step. A cache keeps what later steps need instead, and every attention kind keeps something
different:

* :class:`KVCache` (full and strided attention): all keys and values so far, in a buffer that
  grows by doubling. Strided attention keeps every key too (its pattern reaches back to any
  multiple of the stride); the pattern is applied by the kind itself, on the cached keys,
  thanks to the bottom-right alignment of ``causal``.
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

Shape letters: ``B`` batch, ``H`` heads, ``L`` length (``L_new`` new tokens, ``L_k`` keys held),
``D`` head dim, ``D_v`` value dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from handformer.attention.kinds import AttentionKind
from handformer.attention.linear import LinearAttention, LinearAttentionState
from handformer.attention.local import LocalAttention
from handformer.checks import check_window_size
from handformer.masks import check_mask

__all__ = [
    "LayerCache",
    "KVCache",
    "WindowKVCache",
    "LinearStateCache",
    "DecodingCache",
    "cache_for",
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

    Storage doubles when full, so appending one token costs O(1) amortised copies.
    """

    def __init__(self) -> None:
        super().__init__()
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
                capacity = max(2 * n, 16)
                new_k = k.new_empty(B, H, capacity, D)  # (B, H, capacity, D)
                new_v = v.new_empty(B, H, capacity, v.shape[-1])  # (B, H, capacity, D_v)
                if self._n:
                    new_k[:, :, :self._n] = self._k[:, :, :self._n]
                    new_v[:, :, :self._n] = self._v[:, :, :self._n]
                self._k, self._v = new_k, new_v
            self._k[:, :, self._n:n] = k
            self._v[:, :, self._n:n] = v
        self._n = n
        return self.keys_values()

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
        return attention(q, k_all, v_all, key_mask, causal=L_new > 1,
                         need_weights=need_weights, dropout_p=dropout_p, scale=scale)


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
        out = attention(q, k_all, v_all, key_mask, causal=L_new > 1,
                        need_weights=need_weights, dropout_p=dropout_p, scale=scale)
        start = k_all.shape[2] - min(self.keep_last, k_all.shape[2])
        # .clone() so the window does not keep the whole prompt's storage alive.
        self._k = k_all[:, :, start:].clone()  # (B, H, <= keep_last, D)
        self._v = v_all[:, :, start:].clone()  # (B, H, <= keep_last, D_v)
        self._keep = None if keep_all is None else keep_all[:, start:].clone()
        self.seen += L_new
        return out


class LinearStateCache(LayerCache):
    """The running state of causal linear attention: constant size.

    ``out_i = phi(q_i) . (S + sum_{j<=i} phi(k_j) v_j^T) / (phi(q_i) . (z + sum_{j<=i} phi(k_j))
    + eps)``, with ``S = sum phi(k) v^T`` and ``z = sum phi(k)`` over all earlier tokens,
    computed by the kind's recurrent :meth:`~handformer.attention.linear.LinearAttention.step`.
    Padded keys (mask False) are left out of the sums. The state is kept in float32.
    """

    def __init__(self) -> None:
        super().__init__()
        self.S: Tensor | None = None  # (B, H, D, D_v) float32
        self.z: Tensor | None = None  # (B, H, D) float32

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
        out, state = attention.step(q, k, v, state, mask=key_mask, scale=scale)
        self.S, self.z = state.kv, state.k_sum  # (B, H, D, D_v), (B, H, D)
        self.seen += L_new
        return out, None


def cache_for(attention: AttentionKind) -> LayerCache:
    """The cache an attention kind needs for decoding.

    Local attention gets a :class:`WindowKVCache`, linear attention a
    :class:`LinearStateCache`, every other kind (full, strided, ...) a :class:`KVCache`.

    Raises:
        TypeError: if ``attention`` is not an attention kind.
    """
    if not isinstance(attention, AttentionKind):
        raise TypeError(f"attention must be an attention kind, got {type(attention).__name__}")
    if isinstance(attention, LocalAttention):
        return WindowKVCache(attention.window_size)
    if isinstance(attention, LinearAttention):
        return LinearStateCache()
    return KVCache()


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
