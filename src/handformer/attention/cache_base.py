"""What every layer cache shares: the :class:`LayerCache` interface and the checks of a step.

A decoding step hands a cache the new tokens' ``q, k, v`` and, optionally, a boolean key mask
of the new tokens; the helpers here check them the same way for every cache and join the
key masks of earlier and new tokens. The overview of the caches is in
:mod:`handformer.attention.cache`.

Shape letters: ``B`` batch, ``H`` heads, ``L`` length (``L_new`` new tokens, ``L_k`` keys
held), ``D`` head dim, ``D_v`` value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from handformer.attention.functional import kv_groups
from handformer.attention.kinds import AttentionKind
from handformer.masks import check_mask

__all__ = ["LayerCache"]


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
