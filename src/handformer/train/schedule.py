"""Learning-rate schedules as pure functions of the step (nothing to save but the step).

* ``cosine``: linear warm-up from ``lr / warmup`` to ``lr`` over ``warmup`` steps, then a
  half cosine down to ``min_lr_ratio * lr`` at ``total`` steps.
* ``inverse_sqrt``: the original Transformer's schedule,
  ``d_model^-0.5 * min(s^-0.5, s * warmup^-1.5)``, rescaled so that its peak (at
  ``s = warmup``) is ``lr``: ``lr * min(s / warmup, sqrt(warmup / s))`` with ``s = step + 1``.
* ``constant``: warm-up, then ``lr``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from handformer.checks import check_non_negative_int

__all__ = ["Schedule", "SCHEDULES"]

SCHEDULES = ("cosine", "inverse_sqrt", "constant")


@dataclass(frozen=True)
class Schedule:
    """The learning rate of every optimiser step.

    Args:
        kind: ``"cosine"``, ``"inverse_sqrt"`` or ``"constant"``.
        lr: peak learning rate (> 0).
        warmup: warm-up steps (>= 0).
        total: total steps of the run (>= 1; the end of the cosine).
        min_lr_ratio: final learning rate of ``cosine`` as a fraction of ``lr``, in [0, 1].

    Raises:
        ValueError: for an unknown kind or out-of-range numbers (naming the argument).
    """

    kind: str
    lr: float
    warmup: int
    total: int
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.kind!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not (
                self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        check_non_negative_int("warmup", self.warmup)  # at most 2**31 - 1
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total < 1:
            raise ValueError(f"steps must be a positive integer, got {self.total!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    def __call__(self, step: int) -> float:
        """Learning rate of optimiser step ``step`` (0-based)."""
        s = step + 1
        if self.kind == "inverse_sqrt":
            w = max(self.warmup, 1)
            return self.lr * min(s / w, math.sqrt(w / s))
        if s <= self.warmup:
            return self.lr * s / self.warmup
        if self.kind == "constant":
            return self.lr
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def to_dict(self) -> dict[str, object]:
        """The fields as a JSON-ready dict."""
        return asdict(self)
