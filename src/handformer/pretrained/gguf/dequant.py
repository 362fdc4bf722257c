"""Dequantize one GGUF tensor into a torch tensor, a few rows at a time.

GGUF stores most weights *quantized*: each row is cut into blocks of 32 values (``Q4_0``,
``Q5_0``, ``Q8_0``, ...) or 256 values (the K-quants ``Q2_K``..``Q6_K`` and most ``IQ``
types); a block holds small integers (2 to 8 bits each) and one or more scales (float16, or
6-bit sub-block scales under a float16 super-scale), and a value is ``scale * q`` or
``scale * q + min``. Dequantizing computes those products back into floats; it does not
recover the original weights, only the nearest values the format can hold.

``gguf.quants.dequantize`` (llama.cpp's own Python reference) does the arithmetic, in float32.
Here it is applied to a chunk of rows at a time, and each chunk is written straight into the
output tensor, which is allocated once in the requested dtype: a tensor never needs a second
full-size float32 temporary, and the raw bytes are read through a memory map of each
chunk's byte range only, released when the chunk is done. :func:`dequantize_chunks` hands
the chunks themselves to a reader that stores something smaller (the int8 loader).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Iterator

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from handformer.pretrained.gguf.reader import GGUFFile, TensorInfo

__all__ = ["dequantize_tensor", "dequantize_chunks", "GGUFRows", "supported_types",
           "CHUNK_VALUES"]

CHUNK_VALUES = 1 << 20  # about 4 MB of float32 per chunk: the temporaries stay in cache

# F32 and F16 are handled by gguf.quants.dequantize itself, the rest by its per-type classes.
_NATIVE = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}


def supported_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types ``gguf.quants.dequantize`` can dequantize (in this ``gguf`` version)."""
    return frozenset(_NATIVE | set(quants._type_traits))  # noqa: SLF001 - its type registry


def dequantize_tensor(file: GGUFFile, info: TensorInfo, *, dtype: torch.dtype = torch.float32,
                      row_order: torch.Tensor | None = None, offset: float = 0.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize one tensor of a GGUF file.

    Args:
        file: the parsed file (:func:`~handformer.pretrained.gguf.read_gguf`).
        info: one of ``file.tensors``' values.
        dtype: floating dtype of the result; values are computed in float32 and rounded once.
        row_order: optional int64 tensor of length ``rows`` (the product of all but the last
            dim): row ``r`` of the file goes to row ``row_order[r]`` of the result (how a
            permutation of rows is undone without a second copy).
        offset: added to every value in float32 before rounding to ``dtype`` (``-1.0`` undoes
            llama.cpp's ``w + 1`` Gemma norms).
        out: optional contiguous CPU tensor of shape ``info.shape`` and dtype ``dtype`` to
            write into instead of new memory (a loader's preallocated parameter).

    Returns:
        A tensor of shape ``info.shape`` and dtype ``dtype`` (``out`` when given).

    Raises:
        CheckpointError: for a ggml type ``gguf.quants`` cannot dequantize, values that
            dequantize to NaN or infinity (a damaged scale), or a file that changed size since
            it was read.
        TypeError: for a non-floating ``dtype``.
        ValueError: for a ``row_order`` of the wrong length or an ``out`` of the wrong
            shape, dtype or layout.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    _check(file, info, row_order)
    cols = info.shape[-1]
    rows = info.numel // cols
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype)  # (rows, cols): all dims but the last: rows
    elif (tuple(out.shape) != tuple(info.shape) or out.dtype != dtype
          or out.device.type != "cpu" or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous CPU tensor of shape {tuple(info.shape)} and "
                         f"dtype {dtype} for tensor {info.name!r}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    else:
        out = out.view(rows, cols)  # (rows, cols), the same memory
    # numpy writes straight into float32/16/64 outputs (one thread: the copies are memory-bound
    # and torch's thread pool only adds waiting on a busy machine); bfloat16 goes through torch.
    out_np = None if dtype == torch.bfloat16 else out.numpy()
    for rows_out, values in dequantize_chunks(file, info, row_order=row_order, offset=offset):
        if out_np is not None:
            out_np[rows_out] = values  # rounds once to the output dtype
        else:
            chunk = torch.from_numpy(values).to(dtype)
            if isinstance(rows_out, slice):
                out[rows_out] = chunk
            else:
                out[torch.from_numpy(rows_out)] = chunk
    return out.reshape(info.shape)


def _check(file: GGUFFile, info: TensorInfo, row_order: torch.Tensor | None) -> None:
    if info.ggml_type not in supported_types():
        raise file.error(f"tensor {info.name!r} type", f"{info.ggml_type.name} cannot be "
                         f"dequantized (gguf.quants supports "
                         f"{', '.join(sorted(t.name for t in supported_types()))})")
    rows = info.numel // info.shape[-1]
    if row_order is not None and tuple(row_order.shape) != (rows,):
        raise ValueError(f"row_order must have shape ({rows},) for tensor {info.name!r}, got "
                         f"{tuple(row_order.shape)}")
    current = file.path.stat().st_size
    if current != file.size:
        raise file.error(f"tensor {info.name!r}", f"the file changed size since it was read "
                         f"({file.size} -> {current} bytes)")


def dequantize_chunks(file: GGUFFile, info: TensorInfo, *,
                      row_order: torch.Tensor | None = None, offset: float = 0.0,
                      chunk_values: int = CHUNK_VALUES
                      ) -> Iterator[tuple[slice | np.ndarray, np.ndarray]]:
    """Dequantize one tensor of a GGUF file a chunk of rows at a time (about
    ``CHUNK_VALUES`` values each), for a reader that keeps something smaller than float32.

    Only the chunk's bytes are mapped while it is dequantized (a mapping of the whole tensor
    would keep every page it touched resident until the tensor is done: 178 MB for Gemma 3's
    embedding).

    Args:
        file, info, row_order, offset: as :func:`dequantize_tensor`'s.
        chunk_values: about how many values a chunk holds (whole rows, at least one).

    Returns:
        An iterator of ``(rows, values)``: ``values`` a float32 ``(n, cols)`` array (read-only
        for F32 tensors), ``rows`` where they go in the result (a slice, or an int64 array
        under ``row_order``), every row once.

    Raises:
        CheckpointError, ValueError: as :func:`dequantize_tensor` (the checks on the
            arguments before the first chunk; a NaN or infinite row when it is reached).
    """
    _check(file, info, row_order)
    order = None if row_order is None else row_order.numpy()
    return _chunks(file, info, order, offset, chunk_values)


def _chunks(file: GGUFFile, info: TensorInfo, order: np.ndarray | None, offset: float,
            chunk_values: int = CHUNK_VALUES
            ) -> Iterator[tuple[slice | np.ndarray, np.ndarray]]:
    cols = info.shape[-1]
    rows = info.numel // cols
    block, type_size = GGML_QUANT_SIZES[info.ggml_type]
    row_bytes = cols // block * type_size
    step = max(1, chunk_values // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        # this chunk's bytes alone, unmapped when the chunk is done
        raw = np.memmap(file.path, dtype=np.uint8, mode="r", offset=info.offset + r0 * row_bytes,
                        shape=(r1 - r0, row_bytes))
        with np.errstate(invalid="ignore", over="ignore"):  # reported below, in one line
            values = quants.dequantize(np.asarray(raw), info.ggml_type)  # (r, cols)
            values = values.astype(np.float32, copy=False)
            if not np.isfinite(values.sum()) and not np.isfinite(values).all():
                bad = r0 + int(np.flatnonzero(~np.isfinite(values).all(axis=1))[0])
                raise file.error(f"tensor {info.name!r}", f"row {bad} holds NaN or infinite "
                                 f"values (a damaged {info.ggml_type.name} scale or value)")
        if offset:
            values = values + np.float32(offset)  # in float32, as llama.cpp added it
        elif info.ggml_type == GGMLQuantizationType.F32:  # a view of the map: copied, so
            values = values.copy()  # that the map can go
        del raw
        yield (slice(r0, r1) if order is None else order[r0:r1]), values


class GGUFRows:
    """The rows of one 2-D tensor of a GGUF file, read and dequantized when they are looked
    up: how an int8 model keeps its token embedding (the file stays the only copy; nothing of
    the table is resident, where an int8 table would hold a second copy of a tied head:
    168 MB for Gemma 3). The file is held open, so renaming or deleting it does not matter;
    rewriting it in place does (a change of size is caught at the next lookup).

    Args:
        file: the parsed file.
        info: one of its 2-D tensors.

    Attributes:
        shape: ``(rows, cols)``.

    Raises:
        ValueError: for a tensor that is not 2-D.
        CheckpointError: for a type ``gguf.quants`` cannot dequantize, or a file that changed
            size since it was read.
    """

    def __init__(self, file: GGUFFile, info: TensorInfo) -> None:
        if len(info.shape) != 2:
            raise ValueError(f"GGUFRows reads a 2-D tensor, {info.name!r} has shape "
                             f"{info.shape}")
        _check(file, info, None)
        # the file without its metadata (a 262k-token vocabulary is 37 MB of Python strings)
        self._file = dataclasses.replace(file, metadata={}, value_types={},
                                         tensors={info.name: info})
        self._info = info
        self.shape = info.shape
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        self._row_bytes = info.shape[1] // block * type_size
        self._fd = os.open(file.path, os.O_RDONLY)
        self._closer = weakref.finalize(self, os.close, self._fd)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (an integer tensor of any shape) -> ``(*ids.shape, cols)`` float32,
        as :func:`dequantize_tensor` computes them.

        Raises:
            IndexError: for an id outside ``[0, rows)``.
            CheckpointError: for a file that changed size since it was read.
        """
        rows, cols = self.shape
        flat = ids.reshape(-1)  # (n,)
        low, high = (int(flat.min()), int(flat.max())) if flat.numel() else (0, 0)
        if low < 0 or high >= rows:
            raise IndexError(f"{self._info.name}: row ids must lie in [0, {rows}), got "
                             f"{low if low < 0 else high}")
        if os.fstat(self._fd).st_size != self._file.size:
            raise self._file.error(f"tensor {self._info.name!r}", "the file changed size "
                                   "since it was read")
        if flat.numel() == 1:
            wanted, inverse = flat, None
        else:
            wanted, inverse = torch.unique(flat, return_inverse=True)  # sorted, (u,), (n,)
        size = self._row_bytes
        raw = np.empty((len(wanted), size), dtype=np.uint8)  # (u, bytes per row)
        for i, row in enumerate(wanted.tolist()):
            raw[i] = np.frombuffer(os.pread(self._fd, size, self._info.offset + row * size),
                                   dtype=np.uint8)
        values = torch.from_numpy(np.asarray(quants.dequantize(raw, self._info.ggml_type),
                                             dtype=np.float32))  # (u, cols)
        if inverse is not None:
            values = values[inverse]  # (n, cols)
        return values.reshape(*ids.shape, cols)

    def table(self) -> torch.Tensor:
        """Every row, ``(rows, cols)`` float32 (:func:`dequantize_tensor`)."""
        return dequantize_tensor(self._file, self._info)
