"""Argument checks shared by the whole package (the bottom layer: imports nothing of handformer).

Every check returns the value it accepted (normalised where said) or raises ``ValueError``
with a message that names the argument and the value, so constructors can write
``self.d_model = check_positive_int("d_model", d_model)``.
"""

from __future__ import annotations

import math

__all__ = ["check_positive_int", "check_non_negative_int", "check_dropout", "check_window_size",
           "check_scale", "check_softcap"]


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_non_negative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def check_dropout(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a probability in [0, 1), else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
    return float(value)


def check_window_size(value: object) -> int:
    """Return a sliding-window size: an odd int >= 1, else raise ``ValueError``.

    A query sees ``window_size // 2`` keys on each side of its own position, so the window
    always holds an odd number of keys; an even size would silently act as the next odd one,
    and is refused instead.
    """
    w = check_positive_int("window_size", value)
    if w % 2 == 0:
        raise ValueError(
            f"window_size must be odd (the query's own key plus window_size // 2 on each "
            f"side), got {w}, which would act as {w + 1}; use {w - 1} or {w + 1}"
        )
    return w


def check_scale(value: object) -> float | None:
    """Return an attention score scale: None (the kind's default) or a positive finite number.

    Raises:
        ValueError: for a bool, a non-number, zero, a negative, an infinite or a NaN value.
    """
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"scale must be None or a positive finite number, got {value!r}")
    return float(value)


def check_softcap(value: object) -> float | None:
    """Return an attention soft-cap: None (no cap) or a positive finite number.

    Raises:
        ValueError: for a bool, a non-number, zero, a negative, an infinite or a NaN value.
    """
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"softcap must be None or a positive finite number, got {value!r}")
    return float(value)
