"""A bounded reader of GGUF headers: ``read_gguf(path) -> GGUFFile``.

A GGUF file (llama.cpp's format, versions 2 and 3, little-endian) is::

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value type: u32, value)
    tensor_count x  (name: string, n_dims: u32, dims: n_dims x u64 (innermost first),
                     ggml type: u32, offset: u64 (from the start of the data section))
    padding to ``general.alignment`` (default 32)
    data section: each tensor's bytes at its offset

where a string is a u64 byte length and UTF-8 bytes, and an array value is an element type
(u32), a count (u64) and the elements. A GGUF file is untrusted input: every count, length,
dimension and offset is checked against the file's size *before* anything is read or
allocated for it, so a damaged file is refused within milliseconds with a
:class:`CheckpointError` naming the file and the field, never with a raw numpy error, a
``MemoryError`` or a crash. Nothing here reads tensor data: :mod:`.dequant` does, one tensor at
a time, through its own memory map.

GGUF stores tensor dimensions innermost first (``ne[0]`` is the row length); a
:class:`TensorInfo`'s ``shape`` is in torch order (reversed): a weight matrix is
``(rows, cols)`` = ``(out_features, in_features)``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from handformer.weights import CheckpointError

__all__ = ["GGUFFile", "TensorInfo", "read_gguf", "GGUF_MAGIC", "MAX_DIMS"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535  # the GGUF spec's limit on key (and here tensor name) lengths
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 30
INT64_MAX = (1 << 63) - 1

# Fixed-size value types: struct format (little-endian) and size in bytes.
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<B", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY: dict[int, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# The smallest encodings: a tensor info (empty name, no dims, type, offset) and a key/value.
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8
_MIN_KV = 8 + 4 + 1


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a GGUF file.

    Attributes:
        name: the tensor's GGUF name (``blk.0.attn_q.weight``).
        shape: torch order (GGUF's dims reversed): ``(rows, cols)`` for a matrix.
        ggml_type: the storage type (``gguf.GGMLQuantizationType``).
        offset: absolute byte offset of the first byte in the file.
        nbytes: bytes the tensor occupies.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GGUFFile:
    """A parsed GGUF header over a memory map of the file.

    Attributes:
        path: the file.
        version: the GGUF version (2 or 3).
        metadata: every key/value: numbers as int/float/bool, strings as str, arrays as lists.
        value_types: each key's ``gguf.GGUFValueType`` (an array's is ``(ARRAY, element)``).
        tensors: tensor infos by name, in file order.
        alignment: the data alignment (``general.alignment``, default 32).
        data_offset: absolute offset of the data section.
        size: the file's size in bytes when it was read.
    """

    path: Path
    version: int
    metadata: dict[str, object]
    value_types: dict[str, tuple[GGUFValueType, ...]]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    size: int

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``gemma3``, ...)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: general.architecture is missing or not a "
                                  f"string (got {type(arch).__name__})")
        return arch

    def error(self, field: str, problem: str) -> CheckpointError:
        """A one-line :class:`CheckpointError` naming this file and a field."""
        return CheckpointError(f"{self.path}: {field}: {problem}")


class _Cursor:
    """Sequential little-endian reads over a buffer, each checked against its end."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.end = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {field}: {problem}")

    def need(self, n: int, field: str) -> None:
        if n > self.end - self.pos:
            raise self.fail(field, f"needs {n} bytes at offset {self.pos}, but the file ends at "
                                   f"{self.end} (truncated or corrupt)")

    def u32(self, field: str) -> int:
        self.need(4, field)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, field: str) -> int:
        self.need(8, field)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, field: str, max_len: int | None = None) -> str:
        n = self.u64(f"{field} (string length)")
        if max_len is not None and n > max_len:
            raise self.fail(field, f"string length {n} exceeds the limit of {max_len} bytes")
        self.need(n, field)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(field, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") \
                from None

    def value(self, vtype: int, field: str) -> object:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            size = struct.calcsize(fmt)
            self.need(size, field)
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
            self.pos += size
            if vtype == GGUFValueType.BOOL:
                if v > 1:
                    raise self.fail(field, f"a bool must be 0 or 1, got {v}")
                return bool(v)
            return v
        if vtype == GGUFValueType.STRING:
            return self.string(field)
        if vtype == GGUFValueType.ARRAY:
            return self.array(field)
        raise self.fail(field, f"unknown value type {vtype}")

    def array(self, field: str) -> list[object]:
        etype = self.u32(f"{field} (array element type)")
        count = self.u64(f"{field} (array length)")
        if etype in _NUMPY:
            dtype = np.dtype(_NUMPY[etype])
            self.need(count * dtype.itemsize, f"{field} ({count} array elements)")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            if etype == GGUFValueType.BOOL:
                if count and values.max() > 1:
                    raise self.fail(field, "a bool must be 0 or 1")
                return values.astype(bool).tolist()
            return values.tolist()
        if etype == GGUFValueType.STRING:
            self.need(count * 8, f"{field} ({count} array strings)")
            return self.strings(count, field)
        if etype == GGUFValueType.ARRAY:
            raise self.fail(field, "arrays of arrays are not supported")
        raise self.fail(field, f"unknown array element type {etype}")

    def strings(self, count: int, field: str) -> list[str]:
        """``count`` strings in one pass (Gemma's 262,144 tokens: about 0.1 s); memory grows
        with the strings read, never with the claimed count."""
        buf, pos, end, unpack = self.buf, self.pos, self.end, _U64.unpack_from
        out = []
        append = out.append
        try:
            for i in range(count):
                if end - pos < 8:
                    raise self.fail(f"{field}[{i}]", f"string length at offset {pos} lies past "
                                                     f"the end of the file ({end})")
                (n,) = unpack(buf, pos)
                pos += 8
                if n > end - pos:
                    raise self.fail(f"{field}[{i}]", f"string length {n} at offset {pos - 8} "
                                                     f"runs past the end of the file ({end})")
                append(str(buf[pos:pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError as exc:
            raise self.fail(f"{field}[{len(out)}]", f"not valid UTF-8 ({exc.reason})") from None
        self.pos = pos
        return out


def _tensor_info(cur: _Cursor, index: int, names: set[str]) -> tuple[str, tuple[int, ...],
                                                                      GGMLQuantizationType, int,
                                                                      int]:
    """Read and check one tensor info: ``(name, torch shape, type, relative offset, nbytes)``."""
    name = cur.string(f"tensor {index} name", MAX_KEY_BYTES)
    where = f"tensor {name!r}"
    if name in names:
        raise cur.fail(where, "duplicate tensor name")
    n_dims = cur.u32(f"{where} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"{where} n_dims", f"must be 1..{MAX_DIMS}, got {n_dims}")
    dims = [cur.u64(f"{where} dims[{d}]") for d in range(n_dims)]
    numel = 1
    for d, size in enumerate(dims):
        if size < 1:
            raise cur.fail(f"{where} dims[{d}]", f"must be at least 1, got {size}")
        numel *= size
        if numel > INT64_MAX:
            raise cur.fail(f"{where} dims", f"{dims} hold more than 2**63 - 1 elements")
    raw_type = cur.u32(f"{where} type")
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise cur.fail(f"{where} type", f"unknown ggml type {raw_type}") from None
    if dims[0] % block:
        raise cur.fail(f"{where} dims[0]", f"row length {dims[0]} is not a multiple of "
                                           f"{ggml_type.name}'s block size {block}")
    nbytes = numel // block * type_size
    offset = cur.u64(f"{where} offset")
    return name, tuple(reversed(dims)), ggml_type, offset, nbytes


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and check a GGUF file's header (metadata and tensor infos; no tensor data).

    Args:
        path: the ``.gguf`` file.

    Returns:
        A :class:`GGUFFile`.

    Raises:
        FileNotFoundError: if the file does not exist.
        CheckpointError: (a ``ValueError``) for anything that is not a well-formed GGUF v2/v3
            little-endian file: bad magic or version; counts, string or array lengths that
            run past the end of the file; unknown value or tensor types; a duplicate key or
            tensor name; ``n_dims`` outside 1..4; a zero dimension or an element count over
            2**63 - 1; a row length that is not a multiple of the block size; a bad
            ``general.alignment``; a tensor offset that is not aligned, or a byte range outside
            the file or overlapping another tensor. The one-line message names the file and
            the field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    size = path.stat().st_size
    if size < 24:
        raise CheckpointError(f"{path}: header: the file has {size} bytes, fewer than a GGUF "
                              f"header's 24 (magic, version, tensor and key/value counts)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return _parse(path, memoryview(data), size)
    finally:
        del data


def _parse(path: Path, buf: memoryview, size: int) -> GGUFFile:
    cur = _Cursor(buf, path)
    magic = bytes(buf[:4])
    cur.pos = 4
    if magic != GGUF_MAGIC:
        raise cur.fail("magic", f"expected b'GGUF', got {magic!r}: not a GGUF file")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in (0x0200, 0x0300):
            raise cur.fail("version", "a big-endian GGUF file; only little-endian files are "
                                      "supported")
        raise cur.fail("version", f"GGUF version {version} is not supported (2 or 3)")
    tensor_count = cur.u64("tensor_count")
    kv_count = cur.u64("kv_count")
    room = size - cur.pos
    if tensor_count * _MIN_TENSOR_INFO > room:
        raise cur.fail("tensor_count", f"{tensor_count} tensors cannot fit in a {size}-byte "
                                       f"file")
    if kv_count * _MIN_KV + tensor_count * _MIN_TENSOR_INFO > room:
        raise cur.fail("kv_count", f"{kv_count} key/value pairs (with {tensor_count} tensors) "
                                   f"cannot fit in a {size}-byte file")

    metadata: dict[str, object] = {}
    value_types: dict[str, tuple[GGUFValueType, ...]] = {}
    for i in range(kv_count):
        key = cur.string(f"metadata key {i}", MAX_KEY_BYTES)
        if key in metadata:
            raise cur.fail(key, "duplicate metadata key")
        vtype = cur.u32(f"{key} (value type)")
        start = cur.pos
        metadata[key] = cur.value(vtype, key)
        value_types[key] = (GGUFValueType(vtype),)
        if vtype == GGUFValueType.ARRAY:
            value_types[key] += (GGUFValueType(_U32.unpack_from(buf, start)[0]),)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata:
        if value_types["general.alignment"] != (GGUFValueType.UINT32,):
            raise cur.fail("general.alignment", f"must be a uint32, got "
                                                f"{value_types['general.alignment'][0].name}")
        if not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise cur.fail("general.alignment", f"must be a power of two up to 2**30, got "
                                                f"{alignment!r}")

    infos = []
    names: set[str] = set()
    for i in range(tensor_count):
        info = _tensor_info(cur, i, names)
        names.add(info[0])
        infos.append(info)
    data_offset = -(-cur.pos // alignment) * alignment
    if data_offset > size and tensor_count:
        raise cur.fail("data section", f"starts at {data_offset}, past the end of the file "
                                       f"({size})")

    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset, nbytes in infos:
        where = f"tensor {name!r}"
        if offset % alignment:
            raise cur.fail(f"{where} offset", f"{offset} is not a multiple of the alignment "
                                              f"{alignment}")
        start = data_offset + offset
        if start + nbytes > size:
            raise cur.fail(f"{where} offset", f"bytes {start}..{start + nbytes} lie outside "
                                              f"the {size}-byte file")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offset + a.nbytes > b.offset:
            raise cur.fail(f"tensor {b.name!r} offset", f"its bytes overlap tensor {a.name!r}'s")
    return GGUFFile(path=path, version=version, metadata=metadata, value_types=value_types,
                    tensors=tensors,
                    alignment=alignment, data_offset=data_offset, size=size)
