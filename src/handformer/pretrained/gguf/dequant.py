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
full-size float32 temporary, and the raw bytes are read through a memory map of that
tensor's byte range only, released when the tensor is done.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from handformer.pretrained.gguf.reader import GGUFFile, TensorInfo

__all__ = ["dequantize_tensor", "supported_types", "CHUNK_VALUES"]

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
    if info.ggml_type not in supported_types():
        raise file.error(f"tensor {info.name!r} type", f"{info.ggml_type.name} cannot be "
                         f"dequantized (gguf.quants supports "
                         f"{', '.join(sorted(t.name for t in supported_types()))})")
    cols = info.shape[-1]
    rows = info.numel // cols
    if row_order is not None and tuple(row_order.shape) != (rows,):
        raise ValueError(f"row_order must have shape ({rows},) for tensor {info.name!r}, got "
                         f"{tuple(row_order.shape)}")
    current = file.path.stat().st_size
    if current != file.size:
        raise file.error(f"tensor {info.name!r}", f"the file changed size since it was read "
                         f"({file.size} -> {current} bytes)")
    block, type_size = GGML_QUANT_SIZES[info.ggml_type]
    row_bytes = cols // block * type_size
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
    order = None if row_order is None else row_order.numpy()
    # A memory map of this tensor's bytes alone; dropped (unmapped) when the function returns.
    raw = np.memmap(file.path, dtype=np.uint8, mode="r", offset=info.offset,
                    shape=(rows, row_bytes))
    step = max(1, CHUNK_VALUES // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        with np.errstate(invalid="ignore", over="ignore"):  # reported below, in one line
            values = quants.dequantize(np.asarray(raw[r0:r1]), info.ggml_type)  # (r, cols)
            values = values.astype(np.float32, copy=False)
            if not np.isfinite(values.sum()) and not np.isfinite(values).all():
                bad = r0 + int(np.flatnonzero(~np.isfinite(values).all(axis=1))[0])
                raise file.error(f"tensor {info.name!r}", f"row {bad} holds NaN or infinite "
                                 f"values (a damaged {info.ggml_type.name} scale or value)")
        if offset:
            values = values + np.float32(offset)  # in float32, as llama.cpp added it
        rows_out = slice(r0, r1) if order is None else order[r0:r1]
        if out_np is not None:
            out_np[rows_out] = values  # rounds once to the output dtype
        else:
            if not values.flags.writeable:  # F32 rows are a view of the read-only map
                values = values.copy()
            chunk = torch.from_numpy(values).to(dtype)
            if order is None:
                out[r0:r1] = chunk
            else:
                out[torch.from_numpy(order[r0:r1])] = chunk
    del raw
    return out.reshape(info.shape)
