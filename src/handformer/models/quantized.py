"""Int8 inference, opt in: weights stored in int8, activations still float32.

``load_lm(source, quantize="int8")`` swaps every ``nn.Linear`` of a causal LM (the q/k/v/out
projections, the MLP's, the LM head) for an :class:`Int8Linear` of the same name and the
token embedding for an :class:`Int8Embedding`, as the loader hands it each weight, a few rows
at a time (:meth:`Int8Installer.take_rows`): no weight matrix, and never the whole model,
exists in float32. A head tied to the embedding multiplies by the embedding's own int8 rows.
Everything else stays float32: the norms, the activations, the residual stream, the KV cache.
Hook points sit between the modules, so every hook sees (and may replace) the same float
tensors, at the same names and shapes, as in the float model.

**Weights.** Each output row of ``W`` gets one scale, ``s_r = max|W_r| / 127``, and is
stored as ``round(W_r / s_r)`` in int8 (llama.cpp's Q8_0 does the same per block of 32).

**Activations.** Each call writes its input ``x: (M, K)`` as two int8 rows per row, so that
one integer product recovers it to about 15 bits (one 8-bit row alone loses the small entries
of an input with outlier channels, an LLM's MLP hidden vector: top-1 agreement with float32
fell to 56 % on SmolLM2):

1. each row is scaled by its largest magnitude, ``a_m = max_k |x_mk|``:
   ``u_m = 127.5 x_m / a_m`` lies in ``[-127.5, 127.5]`` (per-token scaling: one token's
   outliers do not coarsen the grid of the others);
2. ``k_m = round(u_m)``, integers in ``[-127, 127]``;
3. ``r_m = 128 (u_m - k_m)``, the rounding error, within ``[-64, 64]``;
4. one product of ``[k; r]`` with the int8 weight, the kernel told the input's scale (1) and
   zero point (128), so that ``k`` quantizes with no error, and
   ``y_m = a_m / 127.5 (Y[k_m] + Y[r_m] / 128)``.

So the input error is at most ``a_m / (255 * 128)`` per entry (half a step of ``r``'s grid,
divided by 128 and by 127.5 / a_m), and ``|y - x W~^T| <= a_m / 32640 * sum_k |W~_nk|`` for
the dequantized weight ``W~`` (plus float32 rounding): tested. The weight is read once per
call, as in a one-row product, where an earlier version of this module made two products
per layer.

**The kernel** is PyTorch's own FBGEMM int8 linear (VNNI on x86), in the form that takes the
input's quantization parameters (``quantized.linear_with_input_q_dq_qweight_dq_output_fp32``;
``linear_dynamic``, the same product, would choose them itself from the input's range):
measured on this project's 2-core host, one thread, it multiplies SmolLM2's 1,536 x 576 MLP
matrix by one row in 27 us and its 49,152 x 576 LM head in 0.8 ms (float32: 70 us and
10.3 ms); over 512 rows 2.4 ms against float32's 9.7 ms. Called through ``torch.ops``, each
call also cost some 10 us of Python and an exception raised and caught inside torch (the
``__torch_function__`` lookup on the packed weight, a ``torch.ScriptObject``): it is called
past both (:func:`_products`), 3.4 us a call. Every other kernel measured was
slower at one row: torch's weight-only ``_weight_int8pack_mm`` (0.05 ms and 4.4 ms with
bfloat16 activations; 0.7 ms and 24 ms with float32 ones), its 4-bit
``_weight_int4pack_mm_for_cpu`` (0.06 ms and 2.0 ms, bfloat16), oneDNN's
``onednn.qlinear_pointwise`` (45 us and 1.9 ms), torchao 0.18's int8 paths (58-92 ms on the
head, measured when this module was first written). ``torch.ao``'s quantized tensors are
deprecated; if they go, this module is the one place to change (docs/llms.md, "Quantized
inference", has the figures and what int8 changes for interpretability).

Reading ``Int8Linear.weight`` or ``Int8Embedding.weight`` returns the *dequantized* float32
matrix (``s_r * q_r``), a new tensor each time: the weights the model actually multiplies by,
so direct logit attribution, ``W_U`` / ``W_E`` / ``W_O`` reads and ``hook_result`` see the
quantized model's own weights.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from handformer.models.int8_weights import QuantizedRows, quantize_tensor, release_free_memory

__all__ = ["Int8Linear", "Int8Group", "check_quantize", "int8_step_linear", "QUANTIZE_CHOICES",
           "RESIDUAL_SCALE"]

QUANTIZE_CHOICES = ("int8", "int4")
RESIDUAL_SCALE = 128.0  # r = 128 (x^ - c): a power of two, so scaling back adds no rounding
_TINY = 1e-30  # a row of zeros is divided by this, not by 0
# Weights are packed for FBGEMM in pieces of at most this many bytes (a piece is copied once
# while it is packed: a 262,144-row head would otherwise need twice its size for a moment).
_PIECE_BYTES = 32 << 20


@contextmanager
def _quiet() -> Iterator[None]:
    """torch warns that quantized tensors are deprecated each time one is made."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantize.*deprecated.*")
        yield


def check_quantize(quantize: object, dtype: torch.dtype | None = None,
                   device: object = "cpu") -> str | None:
    """Validate a ``quantize`` option; return it (None: no quantization).

    Args:
        quantize: None, ``"int8"`` or ``"int4"`` (:mod:`handformer.models.int4`).
        dtype: the model's requested dtype (None or float32 when quantized).
        device: the model's device (the CPU when quantized).

    Returns:
        ``quantize``.

    Raises:
        ValueError: for a value other than None or one of ``QUANTIZE_CHOICES``, a dtype other
            than float32, or a device other than the CPU (the kernels are the CPU's).
    """
    if quantize is None:
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be None or one of {list(QUANTIZE_CHOICES)}, got "
                         f"{quantize!r}")
    if dtype not in (None, torch.float32):
        raise ValueError(f"quantize={quantize!r} keeps the activations in float32: dtype must "
                         f"be float32 (or None), got {dtype}")
    if torch.device(device).type != "cpu":  # type: ignore[arg-type]
        raise ValueError(f"quantize={quantize!r} runs on the CPU only (FBGEMM's kernel), got "
                         f"device={device!r}")
    return quantize


# ---- the kernel -------------------------------------------------------------------------


def _pack(q: Tensor, scales: Tensor) -> tuple[tuple[object, ...], tuple[int, ...]]:
    """FBGEMM's packed form of int8 rows ``q: (N, K)`` with per-row ``scales``, in pieces of
    whole rows (at most ``_PIECE_BYTES`` each): ``(pieces, rows per piece)``."""
    n, k = q.shape
    step = max(1, _PIECE_BYTES // max(k, 1))
    pieces, rows = [], []
    # FBGEMM wants a nonzero scale per row; a zero row multiplies to zero whatever its scale.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales)).double()
    zeros = torch.zeros(min(step, n), dtype=torch.long)
    with _quiet():
        for r0 in range(0, n, step):
            part = q[r0:r0 + step]
            qt = torch._make_per_channel_quantized_tensor(part, scales[r0:r0 + step],
                                                          zeros[:len(part)], 0)
            pieces.append(torch.ops.quantized.linear_prepack(qt, None))
            rows.append(len(part))
            del qt
            if len(part) < n:  # several pieces: the copies' memory back before the next
                release_free_memory()
    return tuple(pieces), tuple(rows)


# ---- activations --------------------------------------------------------------------------


# The input is written in units where the kernel's grid is the integers: u = x * 127.5 / a
# lies in [-127.5, 127.5]; the kernel is told scale 1 and zero point 128 (uint8 0..255 holds
# the integers -128..127), so that the integers k in [-127, 127] quantize with no error. (The
# full 8-bit range: VNNI's instructions accumulate without the overflow that torch's
# reduce_range, 7-bit activations, guards against on older CPUs.)
_HALF = 127.5
_ZERO_POINT = 128
_INTEGERS = (-127, 127)  # k's range (u = 127.5 would round to 128, past the grid)


@functools.cache
def _divisors() -> Tensor:
    """``(2, 1, 1)``: ``a`` over these is the divisor of ``x`` in ``u = x / (a / 127.5)`` and
    in ``128 u`` (``a / (127.5 * 128)`` is ``(a / 127.5) / 128`` exactly: a power of two)."""
    return torch.tensor([_HALF, _HALF * RESIDUAL_SCALE])[:, None, None]


@functools.cache
def _one_row_coefficients() -> Tensor:
    """``(1, 2)``: ``y = a [1, 1/128] / 127.5 @ Y`` for one row (``Y``: the rows k, r)."""
    return torch.tensor([[1.0, 1.0 / RESIDUAL_SCALE]]) / _HALF


class _Stacked:
    """The kernel's input for ``m`` rows of ``k`` features, ``(2m, k)``: the rows ``[k; r]``,
    written in place at each call (a decoding step keeps one per input size)."""

    def __init__(self, m: int, k: int) -> None:
        self.rows = torch.empty(2 * m, k)  # (2m, K)
        self.both = self.rows.view(2, m, k)  # (2, m, K): the rows of k, those of r
        self.integers, self.residuals = self.both[0], self.both[1]  # (m, K) each

    def fill(self, x: Tensor) -> Tensor:
        """Write ``x: (m, k)`` float32 as ``[k; r]`` (see the module doc); return ``a``,
        ``(m, 1)``. Both halves are first written in one division, as ``u`` and ``128 u``;
        then ``k = round(u)`` and ``r = 128 u - 128 k`` (exact: the same bits as
        ``128 (u - k)``)."""
        a = x.abs().amax(dim=-1, keepdim=True).clamp_min_(_TINY)  # (m, 1)
        # (never under autograd: a layer's input that needs a gradient goes through
        # _ThroughWeight, whose forward runs without one; out= would refuse a graph)
        torch.div(x, a / _divisors(), out=self.both)  # (2, m, K): u, 128 u
        self.integers.round_().clamp_(*_INTEGERS)  # integers in [-127, 127]
        self.residuals.add_(self.integers, alpha=-RESIDUAL_SCALE)  # within [-64, 64]
        return a


def _stacked(scratch: dict, m: int, k: int) -> _Stacked:
    """The buffer ``scratch`` holds for ``m`` rows of ``k`` features (made on first use)."""
    stacked = scratch.get((m, k))
    if stacked is None:
        stacked = scratch[m, k] = _Stacked(m, k)
    return stacked


def _combine(y: Tensor, a: Tensor) -> Tensor:
    """The products of ``[k; r]`` (``(2M, N)``) -> ``(M, N)``."""
    m = a.shape[0]
    if m == 1:
        return torch.mm(a * _one_row_coefficients(), y)  # (1, 2) @ (2, N)
    return torch.add(y[:m], y[m:], alpha=1.0 / RESIDUAL_SCALE).mul_(a / _HALF)


# The kernel (FBGEMM): float32 rows quantized with the scale and zero point it is given, times
# the packed int8 weight, float32 out; its own entry point, past torch.ops' Python wrapper.
_KERNEL = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
_KERNEL = getattr(_KERNEL, "_op", _KERNEL)


def _products(stacked: Tensor, pieces: Iterable[object]) -> Tensor:
    """``stacked`` (a plain tensor made here) times each packed piece, side by side.

    With subclasses' ``__torch_function__`` switched off around the call: otherwise torch
    looks for ``__torch_function__`` on the packed weight (a ``torch.ScriptObject``) at every
    call, and that lookup raises and catches an exception inside torch, 8-10 us of the call's
    13 (measured on an 8 x 576 matrix, one thread; 3.4 us without it). Torch-function modes
    still see the call."""
    with torch._C.DisableTorchFunctionSubclass():
        ys = [_KERNEL(stacked, 1.0, _ZERO_POINT, p) for p in pieces]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)


def _combined_products(stacked: Tensor, pieces: tuple[object, ...], rows: tuple[int, ...],
                       a: Tensor) -> Tensor:
    """``_combine(_products(stacked, pieces), a)``, the same bits, each piece's products
    combined straight into its columns of the ``(M, N)`` output.

    For many rows and several pieces (a prompt through Gemma 3's 262,144-row LM head, 6
    pieces): the side-by-side ``(2M, N)`` products of :func:`_products` are never made, a
    copy of 1 GB for 512 tokens there (about 0.45 s of the 4.4 s forward, measured)."""
    m = a.shape[0]
    if m == 1 or len(pieces) == 1:
        return _combine(_products(stacked, pieces), a)
    out = torch.empty(m, sum(rows))  # (M, N)
    scale = a / _HALF  # (M, 1)
    at = 0
    with torch._C.DisableTorchFunctionSubclass():  # (see _products)
        for piece, n in zip(pieces, rows, strict=True):
            y = _KERNEL(stacked, 1.0, _ZERO_POINT, piece)  # (2M, n): rows k, then rows r
            part = out[:, at:at + n]  # (M, n), a view of its columns
            torch.add(y[:m], y[m:], alpha=1.0 / RESIDUAL_SCALE, out=part).mul_(scale)
            at += n
    return out


# ---- modules ------------------------------------------------------------------------------


class Int8Group:
    """The int8 weights of one or more projections that read one input (q/k/v, gate/up, or
    a single layer), packed as one matrix: one product computes them all.

    Args:
        weights: each projection's :class:`~handformer.models.int8_weights.QuantizedRows`,
            one input size.

    Attributes:
        sizes: each projection's output size; ``in_features``: the input size.
    """

    def __init__(self, weights: list[QuantizedRows]) -> None:
        self._set_shapes([tuple(w.shape) for w in weights])
        q = weights[0].q if len(weights) == 1 else torch.cat([w.q for w in weights])
        scales = torch.cat([w.scales for w in weights])
        self.packed, self.rows = _pack(q, scales)
        del q
        # outlier columns: their union U (ascending) and (|U|, sum of out), each projection's
        # exact columns in its rows, zeros where a column of U is not its own
        self.own_columns = [w.columns for w in weights]  # each one's, or None
        own = [c for c in self.own_columns if c is not None]
        self.columns = torch.unique(torch.cat(own)) if own else None
        self.exact_t = None
        if self.columns is not None:
            self.exact_t = torch.zeros(len(self.columns), sum(self.sizes))
            for w, start in zip(weights, self.starts, strict=True):
                if w.columns is not None:
                    at = torch.searchsorted(self.columns, w.columns)
                    self.exact_t[at, start:start + w.shape[0]] = w.exact.t()
        self._last: tuple | None = None  # (input, pointer, version, output, pending)

    def _set_shapes(self, shapes: list[tuple[int, int]]) -> None:
        """``sizes``, ``in_features`` and each projection's first row, ``starts``, from the
        weights' ``(out, in)`` shapes.

        Raises:
            ValueError: for weights of different input sizes.
        """
        if len({shape[1] for shape in shapes}) != 1:
            raise ValueError(f"{type(self).__name__}: weights must share one input size (they "
                             f"multiply one input), got shapes {shapes}")
        self.sizes = [shape[0] for shape in shapes]
        self.in_features = shapes[0][1]
        self.starts = [sum(self.sizes[:i]) for i in range(len(shapes))]

    def product(self, x: Tensor, scratch: dict | None = None) -> Tensor:
        """``x: (M, in_features)`` float32 -> ``(M, sum of sizes)``, no bias.

        ``scratch``: where the kernel's inputs are kept from call to call, ``(M, K)`` ->
        their buffer (the decoding step's, one per step: a buffer is written at every
        call); None: a new one."""
        stacked = _stacked({} if scratch is None else scratch, *x.shape)
        a = stacked.fill(x)  # (M, 1)
        y = _combined_products(stacked.rows, self.packed, self.rows, a)  # (M, N)
        if self.columns is not None:
            y.addmm_(x.index_select(1, self.columns), self.exact_t)  # + x[:, U] W[:, U]^T
        return y

    def output(self, index: int, key: Tensor, x: Tensor) -> Tensor:
        """Projection ``index``'s output for ``x: (M, in_features)`` (``key``: the module's
        input, of which ``x`` is a view): one product serves every projection of a group
        called in turn with the same input tensor (unchanged: same storage, and the same
        version where torch counts one, which it does not for inference tensors)."""
        last, version = self._last, _version(key)
        if (last is not None and last[0] is key and last[1] == key.data_ptr()
                and last[2] == version and index in last[4]):
            y, pending = last[3], last[4] - {index}
        else:
            y, pending = self.product(x), frozenset(range(len(self.sizes))) - {index}
        self._last = (key, key.data_ptr(), version, y, pending) if pending else None
        if len(self.sizes) == 1:
            return y
        start = self.starts[index]
        return y[:, start:start + self.sizes[index]].contiguous()  # (M, out)

    def dequantized(self, index: int) -> Tensor:
        """Projection ``index``'s weight ``(out, in)``, float32, as the product uses it."""
        start, size = self.starts[index], self.sizes[index]
        parts, at = [], 0
        for packed, rows in zip(self.packed, self.rows, strict=True):
            if at < start + size and at + rows > start:  # a piece holding some of its rows
                qweight, _ = torch.ops.quantized.linear_unpack(packed)
                lo, hi = max(start - at, 0), min(start + size - at, rows)
                parts.append(qweight.dequantize()[lo:hi])
            at += rows
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.columns is not None:  # its own exact columns (int8 zeros there); 0 elsewhere
            weight[:, self.columns] += self.exact_t[:, start:start + size].t()
        return weight


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in int8, one scale per output row (outlier columns
    exactly: :mod:`handformer.models.int8_weights`); ``x`` and ``y`` float32.

    Projections that read one input (a layer's q/k/v, gate/up) share one packed matrix, an
    :class:`Int8Group`, when the loader builds them with :meth:`group`: the first one called
    computes all of them and the others take their rows.

    Args:
        weight: the float weight ``(out_features, in_features)``; it is quantized here and
            not kept.
        bias: ``(out_features,)`` float bias, or None. It stays float32 (a parameter named
            ``bias``, as ``nn.Linear``'s).

    Attributes:
        in_features, out_features: as ``nn.Linear``'s.
        activation_dtype: the dtype the layer takes and returns (float32).

    Raises:
        ValueError: for a weight that is not 2-D, or not finite.
    """

    activation_dtype = torch.float32
    _GROUP: Callable[[list], Int8Group] = Int8Group  # what :meth:`group` packs weights into

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"Int8Linear needs a 2-D weight (out, in), got shape "
                             f"{tuple(weight.shape)}")
        self._setup(Int8Group([quantize_tensor(weight)]), 0, bias)

    def _setup(self, group: Int8Group, index: int, bias: Tensor | None) -> None:
        super().__init__()
        self._group, self._index = group, index
        self.out_features, self.in_features = group.sizes[index], group.in_features
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(
                bias.detach(), requires_grad=False)

    @classmethod
    def from_int8(cls, weight: QuantizedRows, bias: Tensor | None = None) -> Int8Linear:
        """The layer of a quantized weight (its ``q`` is not kept: FBGEMM packs a copy)."""
        return cls.group([weight], [bias])[0]

    @classmethod
    def group(cls, weights: list[QuantizedRows], biases: list[Tensor | None]
              ) -> list[Int8Linear]:
        """Layers that read one input, their weights packed together (an
        :class:`Int8Group`; a subclass's own kind of group, ``_GROUP``)."""
        shared = cls._GROUP(weights)
        layers = []
        for index, bias in enumerate(biases):
            layer = cls.__new__(cls)
            layer._setup(shared, index, bias)
            layers.append(layer)
        return layers

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 version of ``linear`` (its weight quantized, its bias kept)."""
        return cls(linear.weight, linear.bias)

    @property
    def _packed(self) -> tuple[object, ...]:
        """The FBGEMM matrices this layer's product reads (its group's)."""
        return self._group.packed

    @property
    def weight(self) -> Tensor:
        """The dequantized weight ``(out_features, in_features)``, float32: a new tensor each
        time (what the layer multiplies by)."""
        return self._group.dequantized(self._index)

    @property
    def exact_columns(self) -> Tensor | None:
        """The input columns whose weights are kept exactly in float32 (ascending), or None
        (:mod:`handformer.models.int8_weights`)."""
        return self._group.own_columns[self._index]

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in_features)`` float32 -> ``(..., out_features)`` float32."""
        if x.dtype != torch.float32:
            raise TypeError(f"Int8Linear takes float32 inputs (its activations stay float32), "
                            f"got {x.dtype}")
        if x.requires_grad and torch.is_grad_enabled():  # attribution patching, saliency
            y = _ThroughWeight.apply(x.reshape(-1, self.in_features), self)  # (M, N)
        else:
            y = self._group.output(self._index, x, x.reshape(-1, self.in_features))  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> Int8Linear:
        """A copy that shares the packed int8 weights (nothing writes them: a model's variant,
        e.g. ``handformer serve``'s per-attention copies, costs no second copy); the bias is
        copied as ``copy.deepcopy`` copies parameters (``memo`` may share it)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        nn.Module.__init__(new)
        for name in ("out_features", "in_features", "training", "_group", "_index"):
            setattr(new, name, getattr(self, name))
        new.bias = copy.deepcopy(self.bias, memo)
        return new

    def extra_repr(self) -> str:
        shared = len(self._group.sizes)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-row weights"
                + (f", packed with {shared - 1} other projection(s)" if shared > 1 else ""))


class _ThroughWeight(torch.autograd.Function):
    """A quantized layer's product with a gradient for its input: the kernel forward, and
    backward ``dL/dx = dL/dy W~`` with the dequantized weight ``W~`` (what the layer
    multiplies by; the rounding of the activations inside the kernel is passed straight
    through). No gradient for the weights, which are not parameters."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor,  # type: ignore[override]
                layer: Int8Linear) -> Tensor:
        ctx.layer = layer
        return layer._group.output(layer._index, x, x)  # (M, out)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad: Tensor) -> tuple[Tensor, None]:
        return grad @ ctx.layer.weight, None  # (M, out) @ (out, in) -> (M, in)


def int8_step_linear(*linears: Int8Linear, scratch: dict | None = None
                     ) -> Callable[[Tensor], Tensor]:
    """One function computing every one of ``linears`` (the same input) on one input, their
    outputs side by side: one product where they are one :class:`Int8Group`, in order.

    Args:
        linears: :class:`Int8Linear` layers that multiply the same input (q/k/v, gate/up).
        scratch: a dict the function keeps the kernel's input buffers in (shared by the
            functions of one decoding step, which run one at a time); None: its own.

    Returns:
        ``x: (B, in) -> (B, sum of out)``, float32.
    """
    scratch = {} if scratch is None else scratch
    groups = {id(m._group) for m in linears}
    whole = (len(groups) == 1 and [m._index for m in linears]
             == list(range(len(linears[0]._group.sizes))))
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat([
        b.detach() if b is not None else torch.zeros(m.out_features)
        for m, b in zip(linears, biases, strict=True)])
    if not whole:  # each its group's rows (a group's product computed once per call)
        def linear(x: Tensor) -> Tensor:
            y = torch.cat([m._group.output(m._index, x, x) for m in linears], dim=-1)
            return y if bias is None else y.add_(bias)

        return linear
    group = linears[0]._group
    if type(group) is not Int8Group:  # another format's group (int4): its own product
        product = group.product

        def linear(x: Tensor) -> Tensor:
            y = product(x)  # (B, sum of out)
            return y if bias is None else y.add_(bias)

        return linear
    # Int8Group.product, flat: a step makes four of these calls per layer, and each Python
    # call between the tensor operations costs (0.5 ms a SmolLM2 step, measured)
    single = group.packed[0] if len(group.packed) == 1 else None
    columns, exact_t, coefficients = group.columns, group.exact_t, _one_row_coefficients()
    held: list = [None, None]  # (batch size, its buffer)

    def linear(x: Tensor) -> Tensor:
        m = x.shape[0]
        stacked = held[1] if held[0] == m else None
        if stacked is None:
            stacked = _stacked(scratch, m, x.shape[1])
            held[:] = m, stacked
        a = stacked.fill(x)  # (B, 1)
        if single is None:
            y = _products(stacked.rows, group.packed)
        else:
            with torch._C.DisableTorchFunctionSubclass():  # (see _products)
                y = _KERNEL(stacked.rows, 1.0, _ZERO_POINT, single)  # (2B, N)
        y = torch.mm(a * coefficients, y) if m == 1 else _combine(y, a)  # (B, N)
        if columns is not None:
            y.addmm_(x.index_select(1, columns), exact_t)  # + x[:, U] W[:, U]^T
        return y if bias is None else y.add_(bias)

    return linear
