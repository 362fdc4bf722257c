"""How answers travel: compact JSON, or a JSON header followed by the raw 8-bit weights.

The viewer's weights are ``N * H * L_q * L_k`` bytes (18.9 MB at 512 tokens for
all-MiniLM-L6-v2). Inside JSON they are base64 text, a third larger, and both sides pay to
encode and parse it. ``?weights=binary`` on ``/api/run`` and ``/api/rollout`` sends them as
they are instead, in one ``application/octet-stream`` body::

    offset 0       4 bytes   b"HFW1" (format and version)
    offset 4       4 bytes   n, unsigned little-endian: the length of the JSON header
    offset 8       n bytes   the UTF-8 JSON answer, exactly the ``?weights=json`` one except
                             that ``viewer.data`` is null and ``viewer.data_bytes`` is set
    offset 8 + n   the rest  ``viewer.data_bytes`` bytes: the uint8 codes, (N, H, L_q, L_k)
                             in C order; value q of head (l, h) stands for
                             lo + q / levels * (hi - lo) with [lo, hi] = scale[l * H + h]

The page reads it with ``fetch(...).arrayBuffer()`` and hands the codes to the viewer as a
``Uint8Array``; :func:`read_binary` reads it in Python.
"""

from __future__ import annotations

import json
import secrets
import struct

import numpy as np

__all__ = ["MAGIC", "BINARY_TYPE", "json_body", "binary_body", "read_binary"]

MAGIC = b"HFW1"
BINARY_TYPE = "application/octet-stream"
_HEAD = struct.Struct("<4sI")  # magic, header length


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_body(result: dict[str, object]) -> bytes:
    """``result`` as compact UTF-8 JSON. The viewer's base64 weights (megabytes at 512 tokens)
    need no escaping, so they are spliced in as bytes instead of going through the encoder.

    Args:
        result: a JSON-ready answer (``viewer.data``, if any, a base64 string).

    Returns:
        The body.
    """
    viewer = result.get("viewer")
    if not isinstance(viewer, dict) or not isinstance(viewer.get("data"), str):
        return _dumps(result).encode("utf-8")
    mark = f"hf-weights-{secrets.token_hex(16)}"  # a fresh nonce: in no token or text
    text = _dumps(result | {"viewer": viewer | {"data": mark}})
    head, tail = text.split(json.dumps(mark), 1)
    return b"".join([head.encode("utf-8"), b'"', viewer["data"].encode("ascii"), b'"',
                     tail.encode("utf-8")])


def binary_body(result: dict[str, object]) -> tuple[bytes, memoryview]:
    """``result``, whose ``viewer.data`` holds the weights as bytes, in the binary format.

    Args:
        result: an answer from :func:`handformer.serve.compute.run` or ``rollout`` made with
            ``binary=True``.

    Returns:
        ``(head, weights)``: the magic, the length and the JSON header; then the codes. The
        body is the two one after the other (sent as two chunks, so the weights are not
        copied again).

    Raises:
        ValueError: if ``result`` holds no viewer bytes.
    """
    viewer = result.get("viewer")
    data = viewer.get("data") if isinstance(viewer, dict) else None
    if not isinstance(data, bytes | memoryview):
        raise ValueError("result has no viewer bytes; compute it with binary=True")
    weights = memoryview(data).cast("B")
    header = _dumps(result | {"viewer": viewer | {"data": None,
                                                  "data_bytes": weights.nbytes}}).encode("utf-8")
    return _HEAD.pack(MAGIC, len(header)) + header, weights


def read_binary(body: bytes) -> dict[str, object]:
    """Read a ``?weights=binary`` answer back into the dict of the JSON answer, with
    ``viewer["data"]`` a read-only uint8 array ``(N, H, L_q, L_k)`` over ``body`` (no copy).

    Args:
        body: the whole response body.

    Returns:
        The answer.

    Raises:
        ValueError: for a body that is not in this format or is cut short.
    """
    if len(body) < _HEAD.size or body[:4] != MAGIC:
        raise ValueError(f"body does not start with {MAGIC!r}: not a handformer binary answer")
    _, n = _HEAD.unpack_from(body)
    if len(body) < _HEAD.size + n:
        raise ValueError(f"body is cut short: the JSON header needs {n} bytes, "
                         f"{len(body) - _HEAD.size} follow")
    result = json.loads(bytes(body[_HEAD.size:_HEAD.size + n]).decode("utf-8"))
    viewer = result["viewer"]
    size = viewer["data_bytes"]
    L_q, L_k = len(viewer["tokens"]), len(viewer["key_tokens"] or viewer["tokens"])
    shape = (viewer["layers"], viewer["heads"], L_q, L_k)
    if len(body) - _HEAD.size - n != size or size != int(np.prod(shape)):
        raise ValueError(f"body holds {len(body) - _HEAD.size - n} weight bytes; the header "
                         f"says {size} for shape {shape}")
    viewer["data"] = np.frombuffer(body, np.uint8, size, _HEAD.size + n).reshape(shape)
    return result
