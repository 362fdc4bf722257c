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

The caches live in their own modules, one job each, and are all importable from here:
:mod:`~handformer.attention.cache_base` (the :class:`LayerCache` interface and the checks
every cache shares), :mod:`~handformer.attention.cache_kv` (:class:`KVCache`,
:class:`StaticKVCache`) and :mod:`~handformer.attention.cache_bounded` (:class:`WindowKVCache`,
:class:`LinearStateCache`). This module picks a layer's cache (:func:`cache_for`) and holds a
whole model's (:class:`DecodingCache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from handformer.attention.cache_base import LayerCache
from handformer.attention.cache_bounded import LinearStateCache, WindowKVCache
from handformer.attention.cache_kv import KVCache, StaticKVCache, grouped_step
from handformer.attention.kinds import AttentionKind, FullAttention
from handformer.attention.linear import LinearAttention
from handformer.attention.local import LocalAttention

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
