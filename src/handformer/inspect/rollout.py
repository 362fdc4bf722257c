"""Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers").

Raw attention says where one layer's queries look among that layer's inputs, but a layer's
inputs are already mixtures of the tokens. Rollout follows the mixing down to the input:

1. per layer, fuse the heads into one ``(L, L)`` matrix ``A`` (mean, or max / min);
2. add the residual connection: ``Â = (1 - r) A + r I`` with ``r = 0.5`` as in the paper, and
   renormalise every row to sum to 1;
3. multiply through the layers: ``R = Â_N ... Â_2 Â_1``.

Row ``i`` of ``R`` is how much output position ``i`` (after the last layer) draws on each input
token. :func:`residual_attention` gives the per-layer ``Â`` (also the edge capacities of
:func:`handformer.inspect.flow.attention_flow`); :func:`attention_rollout` multiplies them.

Shape letters: ``N`` layers, ``B`` batch, ``H`` heads, ``L`` length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["HEAD_FUSIONS", "attention_rollout", "residual_attention", "check_attentions",
           "select_layers"]

HEAD_FUSIONS = ("mean", "max", "min")


def check_attentions(attentions: object, name: str = "attentions") -> list[Tensor]:
    """Validate per-layer self-attention weights and return them as a list.

    Args:
        attentions: a sequence of per-layer ``(B, H, L, L)`` tensors (what
            ``model(..., need_weights=True).attentions`` holds), one ``(N, B, H, L, L)``
            tensor, or a model output with an ``.attentions`` attribute.
        name: the argument name used in error messages.

    Returns:
        The ``N`` tensors ``(B, H, L, L)``.

    Raises:
        TypeError: for anything else (e.g. ``None``: the model ran without weights).
        ValueError: for tensors of the wrong rank, non-square or mismatched shapes.
    """
    if hasattr(attentions, "attentions") and not isinstance(attentions, Tensor):
        attentions = attentions.attentions
    if attentions is None:
        raise TypeError(f"{name} is None: run the model with need_weights=True to get them")
    if isinstance(attentions, Tensor):
        if attentions.dim() != 5:
            raise ValueError(f"{name} as one tensor must be (N, B, H, L, L), got shape "
                             f"{tuple(attentions.shape)}")
        layers = list(attentions.unbind(0))
    elif isinstance(attentions, Sequence) and not isinstance(attentions, str):
        layers = list(attentions)
    else:
        raise TypeError(f"{name} must be a sequence of (B, H, L, L) tensors, got "
                        f"{type(attentions).__name__}")
    if not layers:
        raise ValueError(f"{name} is empty: pass one (B, H, L, L) tensor per layer")
    for i, a in enumerate(layers):
        if not isinstance(a, Tensor) or not a.is_floating_point():
            raise TypeError(f"{name}[{i}] must be a floating torch.Tensor, got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
        if a.dim() != 4 or a.shape[-1] != a.shape[-2]:
            raise ValueError(f"{name}[{i}] must be square self-attention (B, H, L, L), got "
                             f"shape {tuple(a.shape)}")
        if a.shape != layers[0].shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(a.shape)} but {name}[0] has "
                             f"{tuple(layers[0].shape)}: every layer must have the same shape")
    return layers


def select_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """The layer indices to roll out: all (``None``) or an increasing sequence of indices.

    Raises:
        ValueError: for an index outside ``0..num_layers-1``, a repeated or decreasing index,
            or an empty selection.
        TypeError: for indices that are not integers.
    """
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, int | str) or not isinstance(layers, Sequence | range):
        raise TypeError(f"layers must be a sequence of layer indices (e.g. range(3)), got "
                        f"{layers!r}")
    chosen = list(layers)
    if not chosen:
        raise ValueError("layers is empty: pass at least one layer index")
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"layers must hold integers, got {i!r}")
        if not 0 <= i < num_layers:
            raise ValueError(f"layer {i} is out of range: the model has {num_layers} "
                             f"layer{'s' * (num_layers != 1)}, valid layers are "
                             f"0..{num_layers - 1}")
    if any(b <= a for a, b in zip(chosen, chosen[1:], strict=False)):
        raise ValueError(f"layers must be increasing (input to output), got {chosen}")
    return chosen


def _check_mask(attention_mask: Tensor | None, B: int, L: int) -> Tensor | None:
    """``(B, L)`` 1/True = real token -> float64 ``(B, L)`` of 0/1, or None."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a (B, L) tensor, got "
                        f"{type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != (B, L):
        raise ValueError(f"attention_mask must be (B, L) = ({B}, {L}) like the attentions, got "
                         f"shape {tuple(attention_mask.shape)}")
    return (attention_mask != 0).to(torch.float64)


def residual_attention(attentions: object, *, layers: Sequence[int] | None = None,
                       head_fusion: str = "mean", residual: float = 0.5,
                       attention_mask: Tensor | None = None) -> Tensor:
    """Per layer, the heads fused and the residual added: ``Â = (1 - r) A + r I``, rows
    renormalised to sum to 1 (computed in float64).

    Args:
        attentions: per-layer ``(B, H, L, L)`` weights (see :func:`check_attentions`).
        layers: increasing layer indices to keep (default all).
        head_fusion: ``"mean"`` (the paper), ``"max"`` or ``"min"`` over heads.
        residual: the weight ``r`` of the identity, in ``[0, 1]`` (0.5 in the paper).
        attention_mask: optional ``(B, L)``, 1/True for real tokens. Padding positions are
            cut out of the mixing: nothing flows to or from them, and a padding row is
            its own identity.

    Returns:
        float64 ``(N', B, L, L)`` for the ``N'`` chosen layers. A row whose entries are all
        zero (``residual=0`` and a fully masked query) stays zero.

    Raises:
        ValueError, TypeError: for bad attentions, layers, head_fusion, residual or mask.
    """
    all_layers = check_attentions(attentions)
    chosen = select_layers(layers, len(all_layers))
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if isinstance(residual, bool) or not isinstance(residual, int | float) \
            or not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be a number in [0, 1] (0.5 in the paper), got "
                         f"{residual!r}")
    B, _, L, _ = all_layers[0].shape
    keep = _check_mask(attention_mask, B, L)
    stacked = torch.stack([all_layers[i].detach().to("cpu", torch.float64) for i in chosen])
    # (N', B, H, L, L) -> (N', B, L, L)
    if head_fusion == "mean":
        fused = stacked.mean(dim=2)
    elif head_fusion == "max":
        fused = stacked.amax(dim=2)
    else:
        fused = stacked.amin(dim=2)
    if keep is not None:
        fused = fused * keep[None, :, :, None] * keep[None, :, None, :]  # rows and columns
    eye = torch.eye(L, dtype=torch.float64)
    augmented = (1.0 - residual) * fused + residual * eye  # (N', B, L, L)
    total = augmented.sum(dim=-1, keepdim=True)  # (N', B, L, 1)
    return augmented / torch.where(total > 0, total, torch.ones_like(total))


def attention_rollout(attentions: object, *, layers: Sequence[int] | None = None,
                      head_fusion: str = "mean", residual: float = 0.5,
                      attention_mask: Tensor | None = None) -> Tensor:
    """Attention rollout: the residual-augmented attention multiplied through the layers.

    ``R = Â_{l_k} ... Â_{l_1}`` for the chosen layers ``l_1 < ... < l_k`` (see
    :func:`residual_attention` for ``Â``). ``R[b, i, j]`` is how much output position ``i``
    after layer ``l_k`` draws on input token ``j``; each row sums to 1.

    Args:
        attentions: per-layer ``(B, H, L, L)`` weights: ``model(..., need_weights=True)
            .attentions`` of a :class:`~handformer.BertModel`, ``CausalLM`` or ``Encoder``
            (or the output itself).
        layers: increasing layer indices (default all; ``range(k)`` = rollout up to layer
            ``k - 1``, as in the paper's per-layer figures).
        head_fusion: ``"mean"`` (default, the paper), ``"max"`` or ``"min"`` over heads.
        residual: the identity's weight ``r`` in ``(1 - r) A + r I`` (default 0.5).
        attention_mask: optional ``(B, L)`` mask, 1/True = real token, as the tokenizer
            returns it; padding gets no share, and the real rows equal the rollout of the
            unpadded input.

    Returns:
        ``(B, L, L)`` in the attentions' dtype (float32 for half precision), computed in
        float64.

    Raises:
        ValueError: for a layer out of range (the message gives the valid range), an unknown
            head fusion, a residual outside ``[0, 1]`` or a mask of the wrong shape.
        TypeError: for attentions that are not tensors (e.g. ``None``).
    """
    mats = residual_attention(attentions, layers=layers, head_fusion=head_fusion,
                              residual=residual, attention_mask=attention_mask)
    result = mats[0]  # (B, L, L)
    for layer in mats[1:]:
        result = layer @ result  # later layers multiply from the left
    dtype = check_attentions(attentions)[0].dtype
    return result.to(dtype if dtype in (torch.float32, torch.float64) else torch.float32)
