"""4-bit weights (``load_lm(..., quantize="int4")``): groups of 32 weights of a row share a
scale and a zero, the values are 4-bit integers, the product is torch's own 4-bit CPU kernel.

The format. Row ``n`` of a weight ``W: (N, K)`` is cut into groups of ``GROUP`` (32)
consecutive columns; a group's weights are ``w = (q - 8) s + z`` with ``q`` in ``0..15`` and
``s``, ``z`` bfloat16 (the kernel's own format). Quantizing takes the group's minimum ``lo``
and maximum ``hi``: ``s = (hi - lo) / 15`` and ``z = lo + 8 s``, both rounded to bfloat16,
then ``q = round((w - z) / s) + 8``, clamped. That is llama.cpp's Q4_1 (``w = d q + m``, one
``d`` and ``m`` per 32 values), so a weight read from a Q4_1 GGUF file gets its own 4-bit
values back: ``s`` is the file's ``d`` and ``z`` its ``m + 8 d``, up to their rounding to
bfloat16 (tested against ``gguf.quants``). Where a group's values lie on a grid of fewer than
15 steps between ``lo`` and ``hi`` (Q4_K's fitted scales, Q4_0 groups that miss an end), that
grid is taken instead (:func:`_steps`), so Q4_0 and Q4_K tensors come back exactly too. Other
weights (float checkpoints, GGUF files of other types) are quantized from their values, which
costs more than int8's rounding.

The product. ``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies bfloat16 activations
by the packed weight (AVX512-BF16 where the CPU has it); the layer casts its float32 input to
bfloat16 and the result back, so hooks and the residual stream stay float32. Measured on this
project's 2-core host over SmolLM2's 120 layer matrices, one row: 6.7 ms at one thread and 4.0
at two, where FBGEMM's int8 reads twice the bytes (8.2 and 7.3 ms), and each product is three
operations where int8's exact-input scheme makes thirteen. With float32 activations the same
kernel is ~30x slower, and float16 as slow: only bfloat16 is offered. Its cost is precision:
inputs and outputs rounded to bfloat16's 8 bits (int8's inputs keep about 15).

What goes 4-bit: every ``nn.Linear`` projection whose input size is a multiple of 32 (the
kernel's groups) and whose (packed) output size a multiple of 64 (the kernel wants 16; 64
keeps whole blocks of its packed layout, which a prompt's product unpacks), except the LM
head, which stays int8 (:mod:`handformer.models.quantized`) as llama.cpp keeps its output
matrix at 6 or 8 bits; the token embedding is int8's too.

Prompts. From ``PROMPT_ROWS`` (128) rows on the 4-bit kernel is compute-bound and slower than
float32's product (1.1-1.3x on a 512-token prompt); there each product unpacks its weight to
bfloat16 for the call (:func:`unpack_int4`, a few ms a layer) and multiplies through
``torch.mm`` in bfloat16 (oneDNN, about 2x float32 here): 0.83-0.87x float32's prefill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from handformer.models.quantized import Int8Group, Int8Linear

__all__ = ["GROUP", "PROMPT_ROWS", "Int4Group", "Int4Linear", "int4_eligible", "quantize_int4",
           "unpack_int4"]

GROUP = 32  # weights per scale and zero, along a row
_LEVELS = 15  # q in 0..15
_ON_GRID = 1e-3  # a weight this close to a grid point (in steps) lies on the grid
_CHUNK_VALUES = 1 << 16  # weights quantized at a time (a few 256 KB temporaries)
_MIDDLE = 8  # w = (q - 8) s + z: the kernel's convention (tested)
_BLOCK = 64  # the packed layout's rows per block (see unpack_int4)
PROMPT_ROWS = 128  # from this many rows on, a product unpacks the weight (Int4Group.product)
_KERNEL = torch.ops.aten._weight_int4pack_mm_for_cpu
_PACK = torch.ops.aten._convert_weight_to_int4pack_for_cpu


def int4_eligible(out_features: int, in_features: int) -> bool:
    """Whether a ``(out_features, in_features)`` weight goes 4-bit: the input size a
    multiple of ``GROUP`` (the kernel's rule) and the output size of 64 (the kernel wants 16;
    64 keeps whole blocks of its packed layout, which :func:`unpack_int4` reads)."""
    return in_features % GROUP == 0 and out_features % _BLOCK == 0 and in_features > 0


def quantize_int4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """The 4-bit form of a float ``(N, K)`` weight (see the module doc).

    Returns:
        ``(q, scales_and_zeros)``: ``q`` ``(N, K)`` int32 in ``0..15``; ``(K / 32, N, 2)``
        bfloat16, each group's ``s`` and ``z`` (the kernel's layout).

    Raises:
        ValueError: for a weight the kernel cannot take (see :func:`int4_eligible`) or one
            with inf or NaN entries.
    """
    n, k = weight.shape
    if not int4_eligible(n, k):
        raise ValueError(f"int4 needs a weight of (out, in) with in a multiple of {GROUP} and "
                         f"out of {_BLOCK}, got {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"int4: the weight of shape {tuple(weight.shape)} has inf or NaN "
                         f"entries")
    q = torch.empty(n, k, dtype=torch.int32)
    scales_and_zeros = torch.empty(k // GROUP, n, 2, dtype=torch.bfloat16)  # (G, N, 2)
    step = max(1, _CHUNK_VALUES // k)  # rows at a time: the temporaries stay small
    for r0 in range(0, n, step):
        rows = slice(r0, r0 + step)
        q[rows], scales_and_zeros[:, rows] = _quantize_rows(weight[rows].detach().float())
    return q, scales_and_zeros


def _quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`quantize_int4` of ``rows: (m, K)`` float32: ``(q (m, K), (G, m, 2))``."""
    m, k = rows.shape
    groups = rows.reshape(m, k // GROUP, GROUP)  # (m, G, 32)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # (m, G) each
    scale = ((hi - lo) / _steps(groups, lo, hi)).to(torch.bfloat16)
    # a constant group (hi = lo): s = |lo| / 8 (1 for zeros), so that q = 0 gives lo with
    # bfloat16's relative rounding (s = 1 would put lo + 8 in z and round lo away)
    constant = torch.where(lo != 0, lo.abs() / _MIDDLE, torch.ones_like(lo))
    scale = torch.where(scale > 0, scale, constant.to(torch.bfloat16))
    zero = (lo + _MIDDLE * scale.float()).to(torch.bfloat16)  # (m, G)
    q = ((groups - zero.float()[..., None]) / scale.float()[..., None] + _MIDDLE)
    q = q.round_().clamp_(0, _LEVELS).to(torch.int32).reshape(m, k)  # (m, G, 32) -> (m, K)
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1)  # (G, m, 2)


def _steps(groups: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """``(N, G)``: the most steps of ``(hi - lo) / steps`` (at most 15) on whose grid, from
    ``lo``, every weight of the group lies (to ``_ON_GRID`` of a step); 15 where none does.

    A group of 4-bit values ``s q + c`` whose ``q`` do not span all of 0..15 (common in Q4_K,
    whose scales are fitted, not taken from the range) lies on the grid of ``hi - lo`` in
    ``max q - min q`` steps, or a finer one: its values then come back exactly, where 15
    steps of ``(hi - lo) / 15`` would round them again."""
    span = (hi - lo)[..., None]  # (N, G, 1)
    offset = groups - lo[..., None]  # (N, G, 32)
    steps = torch.full_like(lo, float(_LEVELS))
    found = torch.zeros_like(lo, dtype=torch.bool)
    for count in range(_LEVELS, 0, -1):  # the finest grid first
        t = offset * (count / span.clamp_min(1e-30))  # (N, G, 32): positions in steps
        fits = ((t - t.round()).abs().amax(dim=-1) <= _ON_GRID) & ~found  # (N, G)
        steps[fits] = count
        found |= fits
        if bool(found.all()):  # (a Q4_1 file's groups: all at 15 steps, the first pass)
            break
    return steps


class Int4Group(Int8Group):
    """The 4-bit weights of one or more projections that read one input (q/k/v, gate/up, or
    a single layer), packed as one matrix: one product computes them all. What
    :class:`Int8Group` is for int8 (its bookkeeping, :meth:`output`, is shared).

    Args:
        weights: each projection's float weight ``(out, in)``, one input size; quantized
            here (:func:`quantize_int4`), not kept.

    Raises:
        ValueError: as :func:`quantize_int4`, or for weights of different input sizes.
    """

    def __init__(self, weights: list[Tensor]) -> None:  # noqa: D107 (the class says it)
        self._set_shapes([tuple(w.shape) for w in weights])
        whole = weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        q, self.scales_and_zeros = quantize_int4(whole)  # (N, K), (G, N, 2)
        self.packed = _PACK(q, 1)  # (N, K / 2) uint8, the kernel's layout
        del q
        self.rows = (sum(self.sizes),)
        self.own_columns = [None] * len(weights)  # no exact columns: groups of 32 instead
        self.columns = self.exact_t = None
        self._last = None

    def product(self, x: Tensor, scratch: dict | None = None) -> Tensor:
        """``x: (M, in_features)`` float32 -> ``(M, sum of sizes)`` float32, no bias
        (computed in bfloat16). ``scratch`` is accepted for :class:`Int8Group`'s signature.

        A few rows (decoding) go through the 4-bit kernel; from ``PROMPT_ROWS`` rows on (a
        prompt), where that kernel is compute-bound and slower than float32's, the weight is
        unpacked to bfloat16 for this call and multiplied by torch's bfloat16 matrix product
        (oneDNN), about 2x float32's speed (see the module doc)."""
        xb = x.to(torch.bfloat16)
        if x.shape[0] >= PROMPT_ROWS:
            return torch.mm(xb, self._weight(torch.bfloat16).t()).float()  # (M, N)
        return _KERNEL(xb, self.packed, GROUP, self.scales_and_zeros).float()  # (M, N)

    def _weight(self, dtype: torch.dtype) -> Tensor:
        """The whole packed weight ``(N, K)``, ``(q - 8) s + z`` in float32, cast to
        ``dtype``."""
        n, k = sum(self.sizes), self.in_features
        q = unpack_int4(self.packed, n, k).reshape(n, k // GROUP, GROUP)  # (N, G, 32)
        s, z = self.scales_and_zeros.float().unbind(-1)  # (G, N) each
        weight = q.float().sub_(_MIDDLE).mul_(s.t()[..., None]).add_(z.t()[..., None])
        return weight.reshape(n, k).to(dtype)  # (N, G, 32) -> (N, K)

    def dequantized(self, index: int) -> Tensor:
        """Projection ``index``'s weight ``(out, in)``, float32: ``(q - 8) s + z``."""
        start, size = self.starts[index], self.sizes[index]
        return self._weight(torch.float32)[start:start + size].clone()


def unpack_int4(packed: Tensor, n: int, k: int) -> Tensor:
    """The 4-bit values ``q: (n, k)`` (uint8, ``0..15``) of the kernel's packed weight.

    The layout (read off ``_convert_weight_to_int4pack_for_cpu``, tested): rows in blocks of
    64; a block is ``k`` runs of 32 bytes, run ``c`` holding column ``c`` of the block's rows
    ``j`` (low nibble) and ``j + 32`` (high nibble) in byte ``j``. Hence output sizes a
    multiple of 64 (:func:`int4_eligible`)."""
    runs = packed.reshape(n // _BLOCK, k, _BLOCK // 2)  # (blocks, K, 32) bytes
    q = torch.stack([runs & 15, runs >> 4], dim=1)  # (blocks, 2, K, 32): rows j, j + 32
    return q.transpose(-1, -2).reshape(n, k)  # (blocks, 2, 32, K) -> (N, K)


class Int4Linear(Int8Linear):
    """``y = x W^T + b`` with ``W`` in 4-bit groups of 32 (see the module doc); ``x`` and
    ``y`` float32, the product in bfloat16. An :class:`~handformer.models.quantized.Int8Linear`
    in everything else (hooks, ``.weight`` dequantized, deep copies sharing the weights).

    Args:
        weight: the float weight ``(out_features, in_features)``; quantized here, not kept.
        bias: ``(out_features,)`` float bias, or None (kept float32).

    Raises:
        ValueError: as :func:`quantize_int4`.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:  # noqa: D107
        if weight.dim() != 2:
            raise ValueError(f"Int4Linear needs a 2-D weight (out, in), got shape "
                             f"{tuple(weight.shape)}")
        self._setup(Int4Group([weight]), 0, bias)

    _GROUP = Int4Group  # Int8Linear.group packs float weights into one of these

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int4Linear:
        """The 4-bit version of ``linear`` (its weight quantized, its bias kept)."""
        return cls(linear.weight, linear.bias)

    def extra_repr(self) -> str:
        shared = len(self._group.sizes)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, 4-bit weights in groups of {GROUP}"
                + (f", packed with {shared - 1} other projection(s)" if shared > 1 else ""))
