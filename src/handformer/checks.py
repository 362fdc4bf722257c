"""Argument checks shared by the whole package (the bottom layer: imports nothing of handformer).

Every check returns the value it accepted (normalised where said) or raises ``ValueError``
with a message that names the argument and the value, so constructors can write
``self.d_model = check_positive_int("d_model", d_model)``.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

__all__ = ["OptionError", "MAX_INT", "MAX_SEED", "check_positive_int", "check_non_negative_int",
           "check_dropout", "check_window_size", "check_scale", "check_seed", "mkstemp_beside",
           "check_softcap"]

# The largest size, count or length option accepted (window_size, stride, global_tokens,
# max_new_tokens, capacity, dims, steps...): int32's maximum. Real configurations stay far
# below it (a Hugging Face sliding_window of 131072 is a window_size of 262143), and every
# tensor index or product handformer computes from such a value stays inside int64.
MAX_INT = 2**31 - 1
MAX_SEED = 2**63 - 1  # seeds: 0 .. MAX_SEED (what torch.manual_seed and JSON both carry)


class OptionError(ValueError):
    """A bad option value. ``str(exc)`` is ``f"{name} {problem}"``; the command line and the
    server reword it with their own spelling of ``name`` (``--window-size``, a JSON field).

    Attributes:
        name: the option, as a Python keyword (``window_size``).
        problem: the message without the name (``must be a positive integer, got 0``).
    """

    def __init__(self, name: str, problem: str) -> None:
        self.name, self.problem = name, problem
        super().__init__(f"{name} {problem}")


def _too_large(name: str, value: int, maximum: int) -> OptionError:
    return OptionError(name, f"must be at most {maximum} (2**{maximum.bit_length()} - 1), "
                             f"got {value}")


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int in ``1 .. MAX_INT``, else raise ``ValueError`` (an
    :class:`OptionError`) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OptionError(name, f"must be a positive integer, got {value!r}")
    if value > MAX_INT:
        raise _too_large(name, value, MAX_INT)
    return value


def check_non_negative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int in ``0 .. MAX_INT``, else raise ``ValueError`` (an
    :class:`OptionError`) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(name, f"must be a non-negative integer, got {value!r}")
    if value > MAX_INT:
        raise _too_large(name, value, MAX_INT)
    return value


def check_seed(value: object, name: str = "seed") -> int:
    """Return a random seed: an int in ``0 .. MAX_SEED`` (2**63 - 1).

    One rule for the command line, the server and the library: negative seeds are refused
    (torch would accept some of them, but JSON clients and ``handformer train`` could not
    repeat them), and so are floats, bools and larger numbers.

    Raises:
        ValueError: an :class:`OptionError` naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        shown = value if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        raise OptionError(name, f"must be an integer in 0..2**63 - 1, got {shown}")
    return value


def check_dropout(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a probability in [0, 1), else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
    return float(value)


def check_window_size(value: object) -> int:
    """Return a sliding-window size: an odd int in ``1 .. MAX_INT``, else raise ``ValueError``
    (an :class:`OptionError`).

    A query sees ``window_size // 2`` keys on each side of its own position, so the window
    always holds an odd number of keys; an even size would silently act as the next odd one,
    and is refused instead.
    """
    w = check_positive_int("window_size", value)
    if w % 2 == 0:
        raise OptionError(
            "window_size", f"must be odd (the query's own key plus window_size // 2 on each "
            f"side), got {w}, which would act as {w + 1}; use {w - 1} or {w + 1}"
        )
    return w


def check_scale(value: object) -> float | None:
    """Return an attention score scale: None (the kind's default) or a positive finite number.

    Raises:
        ValueError: for a bool, a non-number, zero, a negative, an infinite or a NaN value.
    """
    return _optional_positive_finite("scale", value)


def check_softcap(value: object) -> float | None:
    """Return an attention soft-cap: None (no cap) or a positive finite number.

    Raises:
        ValueError: for a bool, a non-number, zero, a negative, an infinite or a NaN value.
    """
    return _optional_positive_finite("softcap", value)


def _optional_positive_finite(name: str, value: object) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name} must be None or a positive finite number, got {value!r}")
    return float(value)


def mkstemp_beside(path: str | os.PathLike, *, folder: bool = False) -> str:
    """A new hidden temporary file (or folder) in ``path``'s folder, for an atomic write of
    ``path`` (write it, then ``os.replace`` it over ``path``). Every atomic writer of the
    package starts here, so that a failure names the target, not the temporary name.

    Args:
        path: the file (or folder) that will be written.
        folder: make a temporary folder instead of a file.

    Returns:
        The temporary path (a file created empty and closed, or a folder).

    Raises:
        FileNotFoundError: if ``path``'s folder does not exist (the message names both and the
            first missing folder).
        NotADirectoryError: if what should be the folder is a file.
        PermissionError / OSError: if the folder cannot be written (naming target and folder).
    """
    target = Path(path)
    parent = target.parent
    try:
        if folder:
            return tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
        os.close(fd)
        return tmp
    except FileNotFoundError:
        missing = parent
        while not missing.parent.exists() and missing.parent != missing:
            missing = missing.parent
        first = "" if missing == parent else f" ({missing} is missing)"
        raise FileNotFoundError(f"cannot write {target}: its folder {parent} does not "
                                f"exist{first}; create it first") from None
    except NotADirectoryError:
        raise NotADirectoryError(f"cannot write {target}: {parent} is not a folder") from None
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot write {target}: {exc.strerror} (in folder "
                                   f"{parent})") from None
