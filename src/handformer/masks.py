"""Attention masks: one convention, builders, converters and validation.

The convention, used everywhere in handformer:

* a **boolean** mask means ``True`` = "this query may attend this key";
* a **floating** mask is an additive bias on the attention scores (``-inf`` blocks);
* any other dtype is rejected, because an integer 0/1 mask is ambiguous (is 1 "keep" as in
  Hugging Face, or "block" as in ``torch.nn.MultiheadAttention``?).

Masks broadcast to ``(..., L_q, L_k)``. ``causal`` is aligned bottom-right: query ``i`` sits
at key position ``i + L_k - L_q``, which is what an incremental-decoding cache needs (the new
queries are the last ones).

Shape letters: ``B`` batch, ``H`` heads, ``L`` length (``L_q`` queries, ``L_k`` keys).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from handformer.checks import check_non_negative_int, check_positive_int, check_window_size

CONVENTION = (
    "handformer masks are boolean (True = may attend) or floating (an additive bias, "
    "-inf blocks)"
)


def check_mask(mask: Tensor, target_shape: tuple[int, ...], *, name: str = "mask") -> None:
    """Check that ``mask`` follows the convention and broadcasts to ``target_shape``.

    Args:
        mask: the mask to check.
        target_shape: the attention-score shape ``(..., L_q, L_k)`` it must broadcast to.
        name: the argument name used in error messages.

    Raises:
        TypeError: if ``mask`` is not a tensor, or is neither boolean nor floating.
        ValueError: if ``mask`` does not broadcast to ``target_shape`` (without enlarging it),
            or is a floating mask holding only 0 and 1 (a 1 = keep mask passed as a bias by
            mistake; use ``mask.bool()``).

    Warns:
        UserWarning: for a boolean mask with no True entry (every row blocked; likely a
            ``torch.nn.MultiheadAttention`` mask, True = blocked: use :func:`from_torch_mask`).

    The value checks read the mask's data; they are skipped inside ``torch.compile``.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        hint = (
            "; for a 1/0 'keep' mask use handformer.masks.from_hf_attention_mask, for "
            "torch.nn.MultiheadAttention's True = blocked masks use "
            "handformer.masks.from_torch_mask"
        )
        raise TypeError(f"{name} has dtype {mask.dtype}: {CONVENTION}{hint}")
    try:
        shape = torch.broadcast_shapes(tuple(mask.shape), tuple(target_shape))
    except RuntimeError:
        shape = None
    if shape != tuple(target_shape):
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to the attention "
            f"scores' shape {tuple(target_shape)} (..., L_q, L_k); a padding mask for "
            f"(B, H, L_q, L_k) scores is (B, 1, 1, L_k) (from a torch key_padding_mask "
            f"(B, L_k) with True = padding: handformer.masks.from_torch_mask(m)[:, None, None, :])"
        )
    if mask.numel() and not torch.compiler.is_compiling():  # value checks read the data
        _check_mask_values(mask, name)


def _check_mask_values(mask: Tensor, name: str) -> None:
    """Catch masks written in another library's convention (see :func:`check_mask`)."""
    if mask.dtype == torch.bool:
        if not bool(mask.any()):
            warnings.warn(
                f"{name} is a boolean mask with no True entry: every query attends nothing and "
                f"the output is all zeros. handformer's boolean masks mean True = may attend; "
                f"torch.nn.MultiheadAttention's mean True = blocked (convert them with "
                f"handformer.masks.from_torch_mask)", UserWarning, stacklevel=3)
        return
    if bool(((mask == 0) | (mask == 1)).all()) and bool((mask == 1).any()):
        raise ValueError(
            f"{name} is a floating mask holding only 0 and 1: a floating mask is an additive "
            f"bias, so this adds +1 to some scores and blocks nothing. For a 1 = keep / "
            f"0 = padding mask pass {name}.bool() (or handformer.masks.from_hf_attention_mask "
            f"for a (B, L_k) mask); if a 0/+1 bias is really meant, pass {name} - 1 (the same "
            f"softmax)"
        )


def causal_mask(L_q: int, L_k: int | None = None, *, device: torch.device | str | None = None
                ) -> Tensor:
    """Boolean causal mask, aligned bottom-right.

    Args:
        L_q: number of queries.
        L_k: number of keys (defaults to ``L_q``).
        device: where to build the mask.

    Returns:
        ``(L_q, L_k)`` bool tensor, True where key ``j <= i + L_k - L_q``.

    Raises:
        ValueError: if a length is negative.
    """
    L_k = L_q if L_k is None else L_k
    if L_q < 0 or L_k < 0:
        raise ValueError(f"lengths must be >= 0, got L_q={L_q}, L_k={L_k}")
    i = torch.arange(L_q, device=device).unsqueeze(-1)  # (L_q, 1)
    j = torch.arange(L_k, device=device)  # (L_k,)
    return j <= i + (L_k - L_q)  # (L_q, L_k)


def padding_mask(lengths_or_attention_mask: Tensor, max_len: int | None = None) -> Tensor:
    """Key-padding mask ``(B, 1, 1, L_k)`` from lengths or from a 1/0 attention mask.

    Args:
        lengths_or_attention_mask: either a 1-D integer tensor of sequence lengths ``(B,)``
            (real tokens first, padding after), or a 2-D ``(B, L_k)`` mask whose non-zero /
            True entries are real tokens (the Hugging Face convention).
        max_len: ``L_k`` when lengths are given (defaults to the largest length).

    Returns:
        ``(B, 1, 1, L_k)`` bool tensor, True = real token (may be attended).

    Raises:
        ValueError: for other ranks, negative lengths or lengths above ``max_len``.
    """
    x = lengths_or_attention_mask
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    if x.dim() == 2:
        return (x != 0).reshape(x.shape[0], 1, 1, x.shape[1])  # (B, L_k) -> (B, 1, 1, L_k)
    if x.dim() != 1:
        raise ValueError(
            "lengths_or_attention_mask must be lengths (B,) or an attention mask (B, L_k), "
            f"got shape {tuple(x.shape)}"
        )
    if x.is_floating_point() or x.dtype == torch.bool:
        raise TypeError(f"lengths must be an integer tensor, got dtype {x.dtype}")
    if x.numel() and int(x.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {x.tolist()}")
    longest = int(x.max()) if x.numel() else 0
    L_k = longest if max_len is None else max_len
    if longest > L_k:
        raise ValueError(f"a length ({longest}) exceeds max_len={L_k}")
    keep = torch.arange(L_k, device=x.device) < x.unsqueeze(-1)  # (B, L_k)
    return keep.reshape(x.shape[0], 1, 1, L_k)  # (B, 1, 1, L_k)


def from_hf_attention_mask(attention_mask: Tensor) -> Tensor:
    """Convert a Hugging Face ``(B, L_k)`` 1/0 mask (1 = real token) to ``(B, 1, 1, L_k)`` bool.

    Raises:
        ValueError: if the mask is not 2-D or holds values other than 0 and 1.
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be (B, L_k) with 1 = real token, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool and not torch.compiler.is_compiling():
        values = torch.unique(attention_mask)
        if not bool(((values == 0) | (values == 1)).all()):
            raise ValueError(
                f"attention_mask must hold only 0 and 1, found values {values.tolist()[:8]}"
            )
    return padding_mask(attention_mask)


def from_torch_mask(mask: Tensor) -> Tensor:
    """Convert a ``torch.nn.MultiheadAttention`` / ``nn.Transformer`` mask to handformer's.

    torch's boolean masks (``attn_mask``, ``key_padding_mask``) mean True = **blocked**;
    handformer's mean True = **may attend**, so booleans are inverted. Float masks are additive
    in both libraries and are returned unchanged. Note that torch's ``key_padding_mask`` is
    ``(B, L_k)``: reshape the result to ``(B, 1, 1, L_k)`` to broadcast over heads and queries.

    Raises:
        TypeError: for masks that are neither boolean nor floating.
    """
    if mask.dtype == torch.bool:
        return ~mask
    if mask.is_floating_point():
        return mask
    raise TypeError(f"mask has dtype {mask.dtype}: torch masks are boolean or floating")


def window_mask(L_q: int, L_k: int, window_size: int, *, causal: bool = False,
                device: torch.device | str | None = None) -> Tensor:
    """Dense boolean sliding-window pattern (the reference for local attention).

    Query ``i`` (key position ``p = i + L_k - L_q``) may attend key ``j`` iff
    ``|p - j| <= window_size // 2`` (and ``j <= p`` when causal).

    Returns:
        ``(L_q, L_k)`` bool tensor.

    Raises:
        ValueError: if ``window_size`` is not an odd positive integer (an even one would act
            as the next odd one).
    """
    check_window_size(window_size)
    p = torch.arange(L_q, device=device).unsqueeze(-1) + (L_k - L_q)  # (L_q, 1)
    j = torch.arange(L_k, device=device)  # (L_k,)
    allowed = (p - j).abs() <= window_size // 2  # (L_q, L_k)
    if causal:
        allowed = allowed & (j <= p)
    return allowed


def strided_mask(L_q: int, L_k: int, stride: int, *, global_tokens: int = 0,
                 causal: bool = False, device: torch.device | str | None = None) -> Tensor:
    """Dense boolean strided pattern with global tokens (the reference for strided attention).

    Query ``i`` (key position ``p``) may attend key ``j`` iff ``|p - j| < stride``, or
    ``(p - j) % stride == 0``, or ``p < global_tokens``, or ``j < global_tokens``; and
    ``j <= p`` when causal.

    Returns:
        ``(L_q, L_k)`` bool tensor.

    Raises:
        ValueError: for a ``stride`` outside ``1 .. 2**31 - 1`` or ``global_tokens`` outside
            ``0 .. 2**31 - 1``.
    """
    check_positive_int("stride", stride)
    check_non_negative_int("global_tokens", global_tokens)
    p = torch.arange(L_q, device=device).unsqueeze(-1) + (L_k - L_q)  # (L_q, 1)
    j = torch.arange(L_k, device=device)  # (L_k,)
    d = p - j  # (L_q, L_k)
    allowed = (d.abs() < stride) | (d % stride == 0) | (p < global_tokens) | (j < global_tokens)
    if causal:
        allowed = allowed & (j <= p)
    return allowed
