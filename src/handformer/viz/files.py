"""Atomic file writes for the visualiser (temp file in the same folder, then rename)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], write: bytes | Callable[[BinaryIO], None]) -> Path:
    """Write a file so that readers see either the old file or the whole new one.

    Args:
        path: destination; its folder must exist.
        write: the bytes to write, or a function that writes into the open binary file.

    Returns:
        The destination as a :class:`~pathlib.Path`.

    Raises:
        OSError: if the folder is missing or not writable (the temp file is removed).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(write, bytes | bytearray):
                f.write(write)
            else:
                write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
