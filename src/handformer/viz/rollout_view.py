"""Data of the rollout view in ``index.html`` (drawn by ``rollout.js``).

Shape letters: ``L`` length.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

__all__ = ["rollout_payload"]


def _floats(x: object, name: str, L: int) -> list[float] | None:
    if x is None:
        return None
    a = np.asarray(x.detach().cpu().double() if isinstance(x, torch.Tensor) else x,
                   dtype=np.float64).reshape(-1)
    if a.shape != (L,) or not np.isfinite(a).all():
        raise ValueError(f"{name} must hold {L} finite scores (one per token), got shape "
                         f"{tuple(np.shape(x))}")
    return [round(float(v), 6) for v in a]


def rollout_payload(rollout: object, *, row: int = 0, raw: object = None,
                    flow: object = None) -> dict[str, object]:
    """The JSON the rollout view reads: the matrix as 8 bits scaled to ``[0, hi]``, and the
    chosen row's raw attention, rollout and flow as floats.

    Args:
        rollout: ``(L, L)`` (or ``(1, L, L)``) from :func:`handformer.inspect.attention_rollout`.
        row: the output position shown first, whose raw attention and flow are given.
        raw, flow: optional ``(L,)`` scores of that row.

    Returns:
        A dict to pass as ``save_html(..., rollout=...)``.

    Raises:
        ValueError: for a matrix that is not square, scores of the wrong length, or a row
            out of range.
    """
    R = np.asarray(rollout.detach().cpu().double() if isinstance(rollout, torch.Tensor)
                   else rollout, dtype=np.float64)
    while R.ndim > 2 and R.shape[0] == 1:
        R = R[0]
    if R.ndim != 2 or R.shape[0] != R.shape[1] or not np.isfinite(R).all():
        raise ValueError(f"rollout must be one finite (L, L) matrix, got shape "
                         f"{tuple(np.shape(rollout))}")
    L = R.shape[0]
    if not -L <= row < L:
        raise ValueError(f"row {row} is out of range: valid rows are 0..{L - 1}")
    hi = max(float(R.max()), 1e-12)
    levels = np.rint(np.clip(R / hi, 0.0, 1.0) * 255).astype(np.uint8)  # (L, L)
    return {"matrix": base64.b64encode(levels.tobytes()).decode("ascii"), "hi": hi,
            "row": row % L, "rollout_row": _floats(R[row % L], "rollout row", L),
            "raw": _floats(raw, "raw", L), "flow": _floats(flow, "flow", L)}
