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

1. each row is divided by its largest magnitude, ``a_m = max_k |x_mk|``, so that
   ``x^_m`` lies in ``[-1, 1]`` (per-token scaling: one token's outliers do not coarsen the
   grid of the others);
2. ``c_m = q(x^_m)``, ``x^_m`` rounded to the 8-bit grid of ``[-1, 1]`` (step ``2 / 255``);
3. ``r_m = 128 (x^_m - c_m)``, the rounding error, which lies in ``[-1/4, 1/4]``, scaled up
   to that grid's range;
4. one product of ``[c; g; r]`` (``g``: two rows ``-1`` and ``+1`` at column 0 that pin the
   kernel's input range to exactly ``[-1, 1]``, so that ``c`` quantizes with no error) with
   the int8 weight, and ``y_m = a_m (Y[c_m] + Y[r_m] / 128)``.

So the input error is at most ``a_m / (255 * 128)`` per entry (half a step of ``r``'s grid,
divided by 128), and ``|y - x W~^T| <= a_m / 32640 * sum_k |W~_nk|`` for the dequantized
weight ``W~`` (plus float32 rounding): tested. The weight is read once per call, as in a
one-row product, where an earlier version of this module made two products per layer.

**The kernel** is PyTorch's own ``torch.ops.quantized.linear_dynamic`` (FBGEMM, VNNI on x86):
measured on this project's 2-core host, one thread, it multiplies SmolLM2's 1,536 x 576 MLP
matrix by one row in 27 us and its 49,152 x 576 LM head in 0.8 ms (float32: 70 us and
10.3 ms); over 512 rows 2.4 ms against float32's 9.7 ms. Every other kernel measured was
slower at one row: torch's weight-only ``_weight_int8pack_mm`` (0.05 ms and 4.4 ms with
bfloat16 activations; 0.7 ms and 24 ms with float32 ones), its 4-bit
``_weight_int4pack_mm_for_cpu`` (0.06 ms and 2.0 ms, bfloat16), oneDNN's
``onednn.qlinear_pointwise`` (45 us and 1.9 ms), torchao 0.18's int8 paths (58-92 ms on the
head). ``torch.ao``'s quantized tensors are deprecated; if they go, this module is the one
place to change (docs/llms.md, "Quantized inference", has the figures and what int8 changes
for interpretability).

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

from handformer.models.int8_weights import (
    QuantizedRows,
    quantize_tensor,
    quantize_weight,
    release_free_memory,
)

__all__ = ["Int8Linear", "Int8Embedding", "FileEmbedding", "Int8Installer", "check_quantize",
           "quantize_model",
           "int8_step_linear", "QUANTIZE_CHOICES", "RESIDUAL_SCALE"]

QUANTIZE_CHOICES = ("int8",)
# The activations use the full 8-bit range: the host's VNNI instructions accumulate without
# the overflow that reduce_range (7-bit activations) guards against on older CPUs.
_REDUCE_RANGE = False
RESIDUAL_SCALE = 128.0  # r = 128 (x^ - c): a power of two, so scaling back adds no rounding
_TINY = 1e-30  # a row of zeros is divided by this, not by 0
# Weights are packed for FBGEMM in pieces of at most this many bytes (a piece is copied once
# while it is packed: a 262,144-row head would otherwise need twice its size for a moment).
_PIECE_BYTES = 8 << 20


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
        quantize: None or ``"int8"``.
        dtype: the model's requested dtype (None or float32 with ``"int8"``).
        device: the model's device (the CPU with ``"int8"``).

    Returns:
        ``quantize``.

    Raises:
        ValueError: for a value other than None or ``"int8"``, a dtype other than float32, or
            a device other than the CPU (the kernel is the CPU's).
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


@functools.cache
def _grid() -> tuple[float, int]:
    """The scale and zero point FBGEMM picks for an input whose range is ``[-1, 1]``."""
    scale, zero = torch._choose_qparams_per_tensor(torch.tensor([-1.0, 1.0]), _REDUCE_RANGE)
    return float(scale), int(zero)


@functools.cache
def _guard(k: int) -> Tensor:
    """``(2, k)``: ``-1`` and ``+1`` at column 0, zeros elsewhere (pins the range)."""
    g = torch.zeros(2, k)
    g[0, 0], g[1, 0] = -1.0, 1.0
    return g


@functools.cache
def _one_row_coefficients() -> Tensor:
    """``(1, 4)``: ``y = a [1, 0, 0, 1/128] @ Y`` for one input row (``Y``: c, g, g, r)."""
    return torch.tensor([[1.0, 0.0, 0.0, 1.0 / RESIDUAL_SCALE]])


def _prepare(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x: (M, K)`` float32 -> ``([c; g; r] (2M + 2, K), a (M, 1))`` (see the module doc)."""
    scale, zero = _grid()
    a = x.abs().amax(dim=-1, keepdim=True).clamp_min_(_TINY)  # (M, 1)
    xn = x / a  # (M, K), within [-1, 1]
    coarse = torch.fake_quantize_per_tensor_affine(xn, scale, zero, 0, 255)  # on the grid
    residual = xn.sub_(coarse).mul_(RESIDUAL_SCALE)  # (M, K), within [-1/4, 1/4]
    return torch.cat([coarse, _guard(x.shape[-1]), residual]), a


def _combine(y: Tensor, a: Tensor) -> Tensor:
    """The products of ``[c; g; r]`` (``(2M + 2, N)``) -> ``(M, N)``."""
    m = a.shape[0]
    if m == 1:
        return torch.mm(a * _one_row_coefficients(), y)  # (1, 4) @ (4, N)
    return torch.add(y[:m], y[m + 2:], alpha=1.0 / RESIDUAL_SCALE).mul_(a)


def _products(stacked: Tensor, pieces: Iterable[object]) -> Tensor:
    ys = [torch.ops.quantized.linear_dynamic(stacked, p, _REDUCE_RANGE) for p in pieces]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)


# ---- modules ------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in int8, one scale per output row (outlier columns
    exactly: :mod:`handformer.models.int8_weights`); ``x`` and ``y`` float32.

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

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"Int8Linear needs a 2-D weight (out, in), got shape "
                             f"{tuple(weight.shape)}")
        self._setup(quantize_tensor(weight), bias)

    def _setup(self, weight: QuantizedRows, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._packed, self._rows = _pack(weight.q, weight.scales)
        # the outlier columns: their indices (J,) and W[:, J]^T (J, N), added exactly
        self._columns = weight.columns
        self._exact_t = None if weight.exact is None else weight.exact.t().contiguous()
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(
                bias.detach(), requires_grad=False)

    @classmethod
    def from_int8(cls, weight: QuantizedRows, bias: Tensor | None = None) -> Int8Linear:
        """The layer of a quantized weight (its ``q`` is not kept: FBGEMM packs a copy)."""
        layer = cls.__new__(cls)
        layer._setup(weight, bias)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 version of ``linear`` (its weight quantized, its bias kept)."""
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight ``(out_features, in_features)``, float32: a new tensor each
        time (what the layer multiplies by)."""
        parts = []
        for packed in self._packed:
            qweight, _ = torch.ops.quantized.linear_unpack(packed)
            parts.append(qweight.dequantize())
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self._columns is not None:
            weight[:, self._columns] = self._exact_t.t()
        return weight

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in_features)`` float32 -> ``(..., out_features)`` float32."""
        if x.dtype != torch.float32:
            raise TypeError(f"Int8Linear takes float32 inputs (its activations stay float32), "
                            f"got {x.dtype}")
        flat = x.reshape(-1, self.in_features)  # (M, K)
        stacked, a = _prepare(flat)
        y = _combine(_products(stacked, self._packed), a)  # (M, N)
        if self._columns is not None:
            y.addmm_(flat[:, self._columns], self._exact_t)  # + x[:, J] W[:, J]^T
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
        for name in ("out_features", "in_features", "training", "_packed", "_rows",
                     "_columns", "_exact_t"):
            setattr(new, name, getattr(self, name))
        new.bias = copy.deepcopy(self.bias, memo)
        return new

    def extra_repr(self) -> str:
        outliers = 0 if self._columns is None else len(self._columns)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-row weights, {outliers} exact "
                "columns")


class Int8Embedding(nn.Module):
    """A token embedding whose rows are int8, one scale per row (outlier columns exactly);
    a lookup dequantizes only the rows it gathers.

    Args:
        weight: the quantized table ``(num_embeddings, embedding_dim)``
            (:class:`~handformer.models.int8_weights.QuantizedRows`).

    Attributes:
        num_embeddings, embedding_dim: as ``nn.Embedding``'s.
    """

    def __init__(self, weight: QuantizedRows) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self._table = weight

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding | Tensor) -> Int8Embedding:
        """The int8 version of an embedding (or of a ``(V, E)`` float weight)."""
        weight = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
        return cls(quantize_tensor(weight))

    @property
    def weight(self) -> Tensor:
        """The dequantized table ``(num_embeddings, embedding_dim)``, float32: a new tensor
        each time."""
        return self._table.dequantize()

    def head(self) -> Int8Linear:
        """An LM head tied to this embedding: an :class:`Int8Linear` of the same int8 rows."""
        return Int8Linear.from_int8(self._table)

    def forward(self, ids: Tensor) -> Tensor:
        """``(...)`` token ids -> ``(..., embedding_dim)`` float32."""
        return self._table.dequantize(ids)

    def __deepcopy__(self, memo: dict) -> Int8Embedding:
        """A copy sharing the int8 rows (nothing writes them)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        nn.Module.__init__(new)
        new.num_embeddings, new.embedding_dim, new.training = (
            self.num_embeddings, self.embedding_dim, self.training)
        new._table = self._table
        return new

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row weights"


class FileEmbedding(nn.Module):
    """A token embedding whose rows stay in the checkpoint file: a lookup reads and
    dequantizes the rows it gathers (what ``load_lm(file.gguf, quantize="int8")`` installs;
    the file's own values, so the embedding is exactly the float model's).

    Args:
        rows: the row source: ``rows(ids)`` returns ``(*ids.shape, E)`` float32,
            ``rows.table()`` the whole ``(V, E)`` table, ``rows.shape`` is ``(V, E)``
            (:class:`~handformer.pretrained.gguf.dequant.GGUFRows`).

    Attributes:
        num_embeddings, embedding_dim: as ``nn.Embedding``'s.
    """

    def __init__(self, rows: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = rows.shape  # type: ignore[attr-defined]
        self._rows = rows

    @property
    def weight(self) -> Tensor:
        """The whole table ``(num_embeddings, embedding_dim)``, float32, read from the file:
        a new tensor each time."""
        return self._rows.table()  # type: ignore[attr-defined]

    def forward(self, ids: Tensor) -> Tensor:
        """``(...)`` token ids -> ``(..., embedding_dim)`` float32."""
        return self._rows(ids)

    def __deepcopy__(self, memo: dict) -> FileEmbedding:
        """A copy reading the same file."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        nn.Module.__init__(new)
        new.num_embeddings, new.embedding_dim, new.training = (
            self.num_embeddings, self.embedding_dim, self.training)
        new._rows = self._rows
        return new

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the file"


def int8_step_linear(*linears: Int8Linear) -> Callable[[Tensor], Tensor]:
    """One function computing every one of ``linears`` (the same input size) on one input,
    their outputs side by side: the input is prepared once, each weight read once, and the
    outlier columns of all of them added in one product.

    Args:
        linears: :class:`Int8Linear` layers that multiply the same input (q/k/v, gate/up).

    Returns:
        ``x: (B, in) -> (B, sum of out)``, float32.
    """
    pieces = [p for m in linears for p in m._packed]
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat([
        b.detach() if b is not None else torch.zeros(m.out_features)
        for m, b in zip(linears, biases, strict=True)])
    columns, exact_t = _joint_columns(linears)

    def linear(x: Tensor) -> Tensor:
        stacked, a = _prepare(x)
        y = _combine(_products(stacked, pieces), a)  # (B, sum of out)
        if columns is not None:
            y.addmm_(x[:, columns], exact_t)
        return y if bias is None else y.add_(bias)

    return linear


def _joint_columns(linears: tuple[Int8Linear, ...]) -> tuple[Tensor | None, Tensor | None]:
    """The union ``U`` of the layers' outlier columns and ``(|U|, sum of out)``: each layer's
    exact columns in its own output range, zeros where a column is not one of its own."""
    own = [m._columns for m in linears if m._columns is not None]
    if not own:
        return None, None
    union = torch.unique(torch.cat(own))  # ascending
    exact_t = torch.zeros(len(union), sum(m.out_features for m in linears))
    start = 0
    for m in linears:
        if m._columns is not None:
            at = torch.searchsorted(union, m._columns)
            exact_t[at, start:start + m.out_features] = m._exact_t
        start += m.out_features
    return union, exact_t


# ---- installing ---------------------------------------------------------------------------


class Int8Installer:
    """What a loader calls with each float weight of a model built on ``meta``: a linear
    layer's weight becomes an :class:`Int8Linear` in its place at once, the token embedding
    an :class:`Int8Embedding` or a :class:`FileEmbedding` (the float tensor can then be
    freed); everything else is the loader's to install.

    Args:
        model: the model, its parameters still on ``meta``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        head, embedding = getattr(model, "lm_head", None), getattr(model, "tok_emb", None)
        self._tied = (type(head) is nn.Linear and type(embedding) is nn.Embedding
                      and head.weight is embedding.weight)

    def wants(self, name: str) -> bool:
        """Whether ``name`` is a weight this installer quantizes."""
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight":
            return False
        module = self.model.get_submodule(owner)
        return type(module) is nn.Linear or (type(module) is nn.Embedding
                                             and owner == "tok_emb")

    def wants_file_rows(self, name: str) -> bool:
        """Whether ``name`` is the token embedding (it may stay in the file)."""
        return name == "tok_emb.weight" and self.wants(name)

    def take(self, name: str, value: Tensor) -> bool:
        """Install ``value`` if :meth:`wants` ``name`` (True), else False."""
        if not self.wants(name):
            return False
        return self.take_rows(name, tuple(value.shape), lambda: [(slice(None), value)])

    def take_rows(self, name: str, shape: tuple[int, ...], read: Callable[[], Iterable],
                  file_rows: Callable[[Tensor], Tensor] | None = None) -> bool:
        """Install the weight ``name`` of ``shape`` from its rows, read in chunks:
        ``read()`` returns ``(rows, values)`` pairs, ``rows`` a slice or index tensor of the
        rows that ``values`` fill (each row once); it may be called twice
        (:func:`~handformer.models.int8_weights.quantize_weight`). Only the int8 rows are
        kept, and for the token embedding with ``file_rows`` (its rows read from the file,
        see :class:`FileEmbedding`) not even those: a tied head is packed from them, then
        they go. False if not :meth:`wants` it.

        Raises:
            ValueError: for a weight with inf or NaN entries.
        """
        if not self.wants(name):
            return False
        weight = quantize_weight(read, tuple(shape))
        owner = name.rpartition(".")[0]
        module = self.model.get_submodule(owner)
        if type(module) is nn.Embedding:
            if self._tied:
                _replace(self.model, "lm_head", Int8Linear.from_int8(weight))
            _replace(self.model, owner, FileEmbedding(file_rows) if file_rows is not None
                     else Int8Embedding(weight))
        else:
            _replace(self.model, owner, Int8Linear.from_int8(weight, module.bias))
        del weight
        release_free_memory()
        return True

    def tie(self, head: str = "lm_head") -> None:
        """A head tied to the embedding: the embedding's int8 rows, packed for the product
        (nothing to do where :meth:`take_rows` packed it already)."""
        if type(self.model.get_submodule(head)) is Int8Linear:
            return
        embedding = self.model.get_submodule("tok_emb")
        _replace(self.model, head, embedding.head() if isinstance(embedding, Int8Embedding)
                 else Int8Linear(embedding.weight))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_model(model: nn.Module) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for an :class:`Int8Linear` and its
    ``tok_emb`` (an ``nn.Embedding``, if it has one) for an :class:`Int8Embedding`, one at a
    time; a head tied to that embedding shares its int8 rows. Everything else stays as it
    is. For a model already in memory (``load_lm(..., quantize="int8")`` quantizes while it
    reads the checkpoint instead).

    Args:
        model: the model (float32, on the CPU).

    Returns:
        ``model``.
    """
    embedding = getattr(model, "tok_emb", None)
    tied = set()
    if type(embedding) is nn.Embedding:
        tied = {n for n, m in model.named_modules()
                if type(m) is nn.Linear and m.weight is embedding.weight}
        _replace(model, "tok_emb", Int8Embedding.from_embedding(embedding))
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        module = model.get_submodule(name)
        new = (model.tok_emb.head() if name in tied and module.bias is None
               else Int8Linear.from_linear(module))
        _replace(model, name, new)
    return model
