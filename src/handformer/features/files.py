"""Reading dictionary files that may be damaged or hostile: sizes checked before allocating.

A safetensors file's header is read and validated first (:func:`handformer.weights.
read_safetensors_header`: a truncated or corrupt file is refused there), every tensor's shape
and dtype is checked against what the format expects, and only then is each tensor read, with
plain file reads into a fresh tensor of the file's dtype (one copy in memory, no memory map
left behind), and checked for NaN and infinity. A ``.npz`` archive is read the same way: each
array's header (shape, dtype) first, compared with the size the archive declares for it.

Shape letters: ``D`` d_in, ``F`` d_sae, ``O`` d_out.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from handformer.weights import DTYPES, read_safetensors_header

__all__ = ["DictionaryFileError", "read_json", "safetensors_shapes", "read_safetensors",
           "npz_shapes", "read_npz", "MAX_D_IN", "MAX_D_SAE", "check_finite"]

MAX_D_IN = 2**18  # activation widths and feature counts accepted from a file
MAX_D_SAE = 2**24
MAX_CONFIG_BYTES = 1 << 20  # a cfg.json / config.json / config.yaml larger than this is refused
_NPZ_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
               np.dtype(np.float16): torch.float16}
_CHUNK = 1 << 20  # elements per NaN check (bounds the exact check's temporaries)


class DictionaryFileError(ValueError):
    """A dictionary file that cannot be read as the format it claims (named in the message)."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a small config file.

    Raises:
        DictionaryFileError: for a file over 1 MiB, invalid JSON, or not an object.
    """
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise DictionaryFileError(f"{path}: {size} bytes is too large for a config file (at "
                                  f"most {MAX_CONFIG_BYTES})")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DictionaryFileError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise DictionaryFileError(f"{path}: expected a JSON object, got "
                                  f"{type(value).__name__}")
    return value


def check_finite(t: Tensor, name: str, path: Path) -> None:
    """Refuse a tensor holding NaN or infinity, naming it.

    Each chunk's sum is NaN or infinite when the chunk holds a NaN or an infinity (a sum of
    finite values can also overflow: then the chunk is checked value by value), so the common
    case costs one pass and no temporary as large as the tensor."""
    flat = t.reshape(-1)  # a contiguous tensor read from the file: a view
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK]
        if bool(torch.isfinite(chunk.sum())):
            continue
        bad = (~torch.isfinite(chunk)).nonzero()
        if len(bad):
            raise DictionaryFileError(f"{path}: tensor {name!r} holds NaN or infinity (first "
                                      f"at flat index {int(bad[0, 0]) + start}); the file is "
                                      "damaged")


def safetensors_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """``{key: shape}`` of a safetensors file from its header alone, and the raw header.

    Raises:
        DictionaryFileError: for a truncated or corrupt file, or a tensor whose dtype is not a
            float (F64, F32, F16, BF16).
    """
    try:
        header, start = read_safetensors_header(path)
    except ValueError as exc:  # CheckpointError: truncated, corrupt, a pickle suffix
        raise DictionaryFileError(str(exc)) from exc
    shapes = {}
    for key, info in header.items():
        if info.get("dtype") not in DTYPES or not DTYPES[info["dtype"]].is_floating_point:
            raise DictionaryFileError(f"{path}: tensor {key!r} has dtype {info.get('dtype')}; "
                                      "a dictionary's tensors are floats (F32, BF16, F16, F64)")
        shapes[key] = tuple(int(n) for n in info["shape"])
    return shapes, {"header": header, "start": start}


def read_safetensors(path: Path, raw: Mapping[str, Any], keys: list[str]) -> dict[str, Tensor]:
    """Read ``keys`` (checked already against :func:`safetensors_shapes`) into fresh tensors of
    the file's dtype, in file order, each checked for NaN and infinity."""
    header, data_start = raw["header"], raw["start"]
    out: dict[str, Tensor] = {}
    with open(path, "rb") as f:
        for key in sorted(keys, key=lambda k: header[k]["data_offsets"][0]):
            info = header[key]
            begin, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=DTYPES[info["dtype"]])
            if t.numel():
                buf = t.view(-1).view(torch.uint8).numpy()  # (numel * itemsize,) its bytes
                f.seek(data_start + begin)
                if f.readinto(memoryview(buf)) != end - begin:
                    raise DictionaryFileError(f"{path}: the file ended while reading {key!r}; "
                                              "it is truncated (or changed while loading)")
            check_finite(t, key, path)
            out[key] = t
    return out


def npz_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of a ``.npz`` archive from each array's header (no data read).

    Raises:
        DictionaryFileError: for a file that is not a zip archive of ``.npy`` arrays, an array
            of another dtype than float16/32/64, object arrays, or an array whose declared size
            disagrees with the archive's entry.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            return {name: shape for name, (shape, _, _) in _npz_entries(path, archive).items()}
    except zipfile.BadZipFile as exc:
        raise DictionaryFileError(f"{path}: not a readable .npz archive ({exc}); it is "
                                  "truncated or corrupt") from exc


def _npz_entries(path: Path, archive: zipfile.ZipFile
                 ) -> dict[str, tuple[tuple[int, ...], np.dtype, bool]]:
    entries = {}
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            raise DictionaryFileError(f"{path}: entry {info.filename!r} is not a .npy array")
        name = info.filename[:-4]
        with archive.open(info) as f:
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            except ValueError as exc:
                raise DictionaryFileError(f"{path}: array {name!r} has a damaged header "
                                          f"({exc})") from exc
            header_len = f.tell()
        if dtype not in _NPZ_DTYPES:
            raise DictionaryFileError(f"{path}: array {name!r} has dtype {dtype}; a "
                                      "dictionary's arrays are float16, float32 or float64")
        nbytes = math.prod(shape) * dtype.itemsize
        if header_len + nbytes != info.file_size:
            raise DictionaryFileError(f"{path}: array {name!r} declares shape {shape} "
                                      f"({nbytes} bytes) but its archive entry holds "
                                      f"{info.file_size - header_len}; the file is damaged")
        if info.compress_size * 1024 < info.file_size:
            raise DictionaryFileError(f"{path}: array {name!r} would expand from "
                                      f"{info.compress_size} to {info.file_size} bytes; refused")
        entries[name] = (tuple(int(n) for n in shape), dtype, bool(fortran))
    return entries


def read_npz(path: Path, keys: list[str]) -> dict[str, Tensor]:
    """Read ``keys`` of a ``.npz`` archive (checked already with :func:`npz_shapes`) into
    tensors of the archive's dtype, each checked for NaN and infinity."""
    out: dict[str, Tensor] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            entries = _npz_entries(path, archive)
            for key in keys:
                shape, dtype, fortran = entries[key]
                with archive.open(key + ".npy") as f:
                    array = np.lib.format.read_array(f, allow_pickle=False)
                if array.shape != shape:  # the header said otherwise: changed while reading
                    raise DictionaryFileError(f"{path}: array {key!r} changed while reading")
                t = torch.from_numpy(np.ascontiguousarray(array))  # fortran order: one copy
                check_finite(t, key, path)
                out[key] = t
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise DictionaryFileError(f"{path}: not a readable .npz archive ({exc}); it is "
                                  "truncated or corrupt") from exc
    return out


def check_shapes(path: Path, shapes: Mapping[str, tuple[int, ...]],
                 expected: Mapping[str, tuple[int, ...]], optional: tuple[str, ...] = (),
                 name_of: Callable[[str], str] = str) -> None:
    """Refuse missing keys and mis-shaped tensors, naming the key and both shapes."""
    for key, shape in expected.items():
        if key not in shapes:
            if key in optional:
                continue
            raise DictionaryFileError(f"{path}: missing tensor {name_of(key)!r} (expected "
                                      f"shape {shape}); found {sorted(shapes)}")
        if tuple(shapes[key]) != tuple(shape):
            raise DictionaryFileError(f"{path}: tensor {name_of(key)!r} has shape "
                                      f"{tuple(shapes[key])}, expected {tuple(shape)}")


def check_sizes(path: Path, **sizes: int) -> None:
    """Refuse sizes (``d_in``, ``d_sae``, ``d_out``) that are not positive or implausibly
    large, before anything is allocated from them."""
    for name, value in sizes.items():
        limit = MAX_D_SAE if name == "d_sae" else MAX_D_IN
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
            raise DictionaryFileError(f"{path}: {name} = {value!r} is out of range (1 .. "
                                      f"{limit})")
