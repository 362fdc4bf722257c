"""The matrix-vector kernel of the decoding step: which one multiplies ``x`` by a weight.

A decoding step multiplies a few rows (``x: (B, E)``, ``B`` the batch, usually 1) by every
weight matrix ``W: (out, in)`` of the model once, so its time is the time to read ``W``. In
float32 ``F.linear`` (MKL's sgemv) reads it near the host's bandwidth. In bfloat16 it does
not: on CPU, ``F.linear`` hands a bfloat16 product to oneDNN's ``brg_matmul`` with ``W`` in
its plain layout (``ONEDNN_VERBOSE=1`` shows ``wei:bf16::blocked:ba``), and measured here
(AVX512-BF16 host, 1 thread) that streams 2-7 GB/s for a SmolLM2 MLP matrix where float32
streams ~45: half the bytes, twice the time.

What fixes it is the layout. The AVX512-BF16 instruction ``vdpbf16ps`` multiplies pairs of
bfloat16 values and adds both products into one float32 lane (32 products per instruction);
it wants each pair of input features of one output side by side in memory. oneDNN's
inner-product primitive reads ``W`` in a blocked layout made for it (``AB16b64a2b``: blocks of
64 outputs x 16 inputs, the inputs in pairs), so the kernel streams ``W`` once, front to back,
in whole cache lines. :func:`step_linear` reorders each bfloat16 weight to that layout once
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplies with
``torch.ops.mkldnn._linear_pointwise``: measured here 3-10x the bandwidth of ``F.linear`` on
the same weights (see docs/precision.md). The sums are float32 either way and the output is
rounded once to bfloat16, as ``F.linear``'s.

The cost is memory: the blocked copy is a second copy of each bfloat16 weight matrix, held
while the model lives (a bfloat16 model decoding holds as much as its float32 model would).
The copies are made at the first ``generate`` and reused while the weights are unchanged;
float32, float64, float16 and non-CPU weights, or a torch without oneDNN's bfloat16 support,
keep ``F.linear``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["StepLinears", "blocked_bf16_available"]

Linear = Callable[[Tensor], Tensor]  # (B, in) -> (B, out)


@functools.cache
def blocked_bf16_available() -> bool:
    """Whether this torch and CPU run oneDNN's bfloat16 inner product (AVX512-BF16 or AMX, or
    the AVX512 emulation oneDNN accepts)."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# model -> {(data_ptr, shape, stride): (version, blocked weight)}: one model's blocked copies,
# dropped with the model
_BLOCKED: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _version(weight: Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


class StepLinears:
    """Makes the decoding step's linear functions for one model, :meth:`__call__` per weight.

    Args:
        model: the model whose weights are multiplied; its blocked bfloat16 copies are kept
            while it lives, and those not asked for by this builder are dropped.
    """

    def __init__(self, model: nn.Module) -> None:
        self._old = _BLOCKED.get(model, {})
        self._new: dict = {}
        _BLOCKED[model] = self._new
        # the int8 products' input buffers, shared by one step's layers (they run in turn)
        self.int8_scratch: dict = {}

    def __call__(self, weight: Tensor, bias: Tensor | None) -> Linear:
        """``x -> F.linear(x, weight, bias)``, by the fastest kernel for ``weight``.

        Args:
            weight: ``(out, in)``.
            bias: ``(out,)`` or None.

        Returns:
            A function of ``x: (B, in)`` returning ``(B, out)``.
        """
        if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
                or weight.dim() != 2 or not blocked_bf16_available()):
            return functools.partial(F.linear, weight=weight, bias=bias)
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride())
        version = _version(weight)
        held = self._old.get(key) or self._new.get(key)
        if held is None or held[0] is None or held[0] != version:
            with torch.no_grad():
                held = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        self._new[key] = held
        blocked = held[1]
        bias = None if bias is None else bias.detach()

        def linear(x: Tensor) -> Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")

        return linear
