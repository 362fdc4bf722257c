"""Atomic file writes for the visualiser (temp file in the same folder, then rename)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from handformer.checks import mkstemp_beside

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], write: bytes | Callable[[BinaryIO], None]) -> Path:
    """Write a file so that readers see either the old file or the whole new one.

    Args:
        path: destination; its folder must exist.
        write: the bytes to write, or a function that writes into the open binary file.

    Returns:
        The destination as a :class:`~pathlib.Path`.

    Raises:
        OSError: if the folder is missing or not writable (the message names ``path`` and
            its folder; the temp file is removed).
    """
    path = Path(path)
    tmp = mkstemp_beside(path)  # a missing folder is named, not the temporary file
    try:
        with open(tmp, "wb") as f:
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
