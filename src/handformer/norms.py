"""Normalisation layers with a hook on their divisor: LayerNorm and RMSNorm.

Shape letters: ``B`` batch, ``L`` length, ``E`` the normalised (last) dim.

* :class:`LayerNorm` (Ba et al., 2016; GPT-2, BERT): ``y = (x - mean) / sqrt(var + eps) * w + b``
  over the last dim. It *is* a ``torch.nn.LayerNorm`` (same parameters, same state-dict keys
  ``weight`` and ``bias``), with one hook point more.
* :class:`RMSNorm` (Zhang & Sennrich, 2019; Llama, Qwen, Mistral, Gemma): no centring, no bias,
  ``y = x / sqrt(mean(x^2) + eps) * (offset + w)``. Gemma's checkpoints store ``w`` and its
  model multiplies by ``1 + w``: that is ``offset=1.0``. For float16/bfloat16 inputs the
  whole norm is computed in float32 and the result cast back (what the reference
  implementations do: the mean of squares of half-precision numbers over thousands of
  features loses too much).

Both expose ``hook_scale``, the divisor ``sqrt(var + eps)`` or ``sqrt(mean(x^2) + eps)``
``(B, L, 1)``: what TransformerLens calls ``ln.hook_scale``, needed to attribute through a norm
(a direct logit attribution divides each component by the same scale); and
``hook_normalized``, the norm's output ``(B, L, E)`` (weight and bias applied), as
TransformerLens' ``ln2.hook_normalized``: what the MLP after ``ln2`` reads, the input of a
transcoder. Every norm has both, a block's QK-norms included
(``blocks.0.attn.q_norm.hook_normalized``: each head's query before the rotation). While a
hook listens to ``hook_scale`` the norm is computed explicitly from that (possibly replaced)
divisor; otherwise by torch's fused kernel (LayerNorm) or the plain formula (RMSNorm).

This module imports only :mod:`handformer.hooks` and :mod:`handformer.checks`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.checks import check_positive_int
from handformer.hooks import HookPoint

__all__ = ["LayerNorm", "RMSNorm", "make_norm", "NORMS"]

NORMS = ("layer", "rms")
_HALF = (torch.float16, torch.bfloat16)


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    return float(eps)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dim, with a ``hook_scale`` hook point.

    Args:
        dim: the normalised dim ``E``.
        eps: added to the variance.
        bias: learn a bias (``b``); the weight is always learnt.

    Hook points: ``hook_scale`` ``(..., 1)``, the divisor ``sqrt(var + eps)`` (biased
    variance); ``hook_normalized`` ``(..., E)``, the output.

    Raises:
        ValueError: for a non-positive ``dim`` or ``eps``.
    """

    def __init__(self, dim: int, *, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(check_positive_int("dim", dim), eps=_check_eps(eps), bias=bias)
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """``(..., E)`` -> ``(..., E)``."""
        if not self.hook_scale.listening():
            return self.hook_normalized(
                F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps))
        xf = x.float() if x.dtype in _HALF else x
        centred = xf - xf.mean(dim=-1, keepdim=True)  # (..., E)
        var = centred.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        scale = self.hook_scale(torch.sqrt(var + self.eps))  # (..., 1)
        y = centred / scale * self.weight.to(xf.dtype)
        if self.bias is not None:
            y = y + self.bias.to(xf.dtype)
        return self.hook_normalized(y.to(x.dtype))


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.

    Args:
        dim: the normalised dim ``E``.
        eps: added to the mean of squares.
        offset: added to the weight when applied (Gemma: 1.0, its checkpoints store ``w``
            for a scale ``1 + w``); 0 for Llama, Qwen, Mistral.

    The parameter is ``weight`` ``(dim,)``, initialised so that the scale is 1
    (``1 - offset``). Half-precision inputs are normalised in float32 and cast back.

    Hook points: ``hook_scale`` ``(..., 1)``, the divisor ``sqrt(mean(x^2) + eps)``;
    ``hook_normalized`` ``(..., E)``, the output.

    Raises:
        ValueError: for a non-positive ``dim`` or ``eps``, or an ``offset`` that is not a
            finite number.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.eps = _check_eps(eps)
        if (isinstance(offset, bool) or not isinstance(offset, (int, float))
                or not math.isfinite(offset)):
            raise ValueError(f"offset must be a finite number, got {offset!r}")
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset))
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """``(..., E)`` -> ``(..., E)``, in ``x``'s dtype."""
        xf = x.float() if x.dtype in _HALF else x
        weight = self.weight.to(xf.dtype)
        if self.offset:
            weight = self.offset + weight
        if not self.hook_scale.listening():  # torch's fused kernel: x * rsqrt(mean(x^2) + eps) * w
            return self.hook_normalized(
                F.rms_norm(xf, (xf.shape[-1],), weight, self.eps).to(x.dtype))
        mean_sq = xf.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        normed = xf / self.hook_scale(torch.sqrt(mean_sq + self.eps))  # (..., E)
        return self.hook_normalized((normed * weight).to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, offset={self.offset}"


def make_norm(kind: str, dim: int, *, eps: float, offset: float = 0.0,
              bias: bool = True) -> LayerNorm | RMSNorm:
    """A norm by name: ``"layer"`` (:class:`LayerNorm`) or ``"rms"`` (:class:`RMSNorm`).

    Args:
        kind: ``"layer"`` or ``"rms"``.
        dim: the normalised dim.
        eps: the norm's epsilon.
        offset: RMSNorm's weight offset (must be 0 for LayerNorm).
        bias: LayerNorm's bias (RMSNorm has none; ignored there).

    Raises:
        ValueError: for an unknown ``kind``, or an ``offset`` with LayerNorm.
    """
    if kind == "layer":
        if offset:
            raise ValueError(f"norm offset={offset!r} applies to RMSNorm only (norm='rms'), "
                             "not to LayerNorm")
        return LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rms":
        return RMSNorm(dim, eps=eps, offset=offset)
    raise ValueError(f"norm must be one of {list(NORMS)}, got {kind!r}")
