"""Two models on one input, hook point by hook point: where do they part?

:func:`compare_runs` runs both models with every (or the chosen) hook point kept and reports,
for each point both models have, how far the second model's activation is from the first's,
and how their outputs agree. Its first use is a quantized model against its float32 original
(``load_lm(..., quantize="int8")`` or ``"int4"``): which layer's residual stream moves first,
which heads' patterns move at all, whether the top-1 tokens survive. It works for any two
models with the same hook names (a fine-tuned model against its base, two checkpoints of one
run).

For an activation ``a`` (first model) and ``b`` (second), per point:

* ``max_abs = max |b - a|``;
* ``rel_l2 = ||b - a|| / ||a||`` over the whole tensor (0 when both are zero, ``inf`` when
  only ``a`` is);
* ``cosine``: the mean over rows (every index but the last) of the cosine of ``a`` and ``b``
  along the last axis (``F.cosine_similarity``, eps 1e-8);
* for attention patterns and scores (``(B, H, L_q, L_k)``), ``per_head``: ``max |b - a|``
  for each head.

Outputs (logits ``(B, L, V)``): top-1 agreement over the positions, the mean over positions
of ``KL(softmax a || softmax b)`` (in float64), and ``max |b - a|``; positions where
``attention_mask`` is 0 are left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.inspect.points import hook_points, select_names
from handformer.inspect.run import run_with_hooks

__all__ = ["PointDiff", "RunComparison", "compare_runs"]

_HEADED = ("hook_pattern", "hook_attn_scores")  # (B, H, L_q, L_k): a head per index 1


@dataclass(frozen=True)
class PointDiff:
    """How far one hook point's activation moved from the first model to the second.

    Attributes:
        name: the hook point.
        shape: the activation's shape (the same in both models).
        max_abs: ``max |b - a|``.
        rel_l2: ``||b - a|| / ||a||``.
        cosine: mean cosine of ``a`` and ``b`` along the last axis.
        per_head: ``max |b - a|`` per head for attention patterns and scores, else None.
    """

    name: str
    shape: tuple[int, ...]
    max_abs: float
    rel_l2: float
    cosine: float
    per_head: tuple[float, ...] | None = None


@dataclass(frozen=True)
class RunComparison:
    """What :func:`compare_runs` found: the points in the order they ran and the outputs'
    agreement.

    Index it by hook name (``comparison["blocks.3.hook_resid_post"]``) or iterate over its
    :class:`PointDiff` rows.

    Attributes:
        points: one :class:`PointDiff` per hook point both models have, in the order the
            second model ran them (the first's, for models of one architecture).
        top1_agreement: share of (unmasked) positions where both outputs' argmax agree (None
            when the models' outputs are not logits of one shape).
        mean_kl: mean over positions of ``KL(first || second)`` of the softmaxed outputs.
        max_logit_diff: ``max |b - a|`` over the outputs.
        only_in_first, only_in_second: kept points that one model does not have.
        shape_mismatch: points both have with different shapes (not compared).
    """

    points: tuple[PointDiff, ...]
    top1_agreement: float | None
    mean_kl: float | None
    max_logit_diff: float | None
    only_in_first: tuple[str, ...] = ()
    only_in_second: tuple[str, ...] = ()
    shape_mismatch: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> PointDiff:
        for point in self.points:
            if point.name == name:
                return point
        raise KeyError(f"no hook point {name!r} was compared (compared: {len(self.points)} "
                       f"points, e.g. {[p.name for p in self.points[:3]]})")

    def __iter__(self) -> Iterator[PointDiff]:
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def worst(self, n: int = 10) -> list[PointDiff]:
        """The ``n`` points that moved most, by ``rel_l2``, largest first."""
        return sorted(self.points, key=lambda p: p.rel_l2, reverse=True)[:n]

    def first_divergence(self, threshold: float = 0.0) -> PointDiff | None:
        """The first point, in the order they ran, whose ``rel_l2`` exceeds ``threshold``
        (None if none does): where the second model starts to compute something else."""
        return next((p for p in self.points if p.rel_l2 > threshold), None)

    def table(self, n: int | None = None) -> str:
        """A plain-text table of the points (the ``n`` worst if given, else all, in order)
        under a line with the outputs' agreement."""
        rows = self.points if n is None else self.worst(n)
        lines = []
        if self.top1_agreement is not None:
            lines.append(f"top-1 agreement {self.top1_agreement:.1%}, mean KL "
                         f"{self.mean_kl:.3g}, max logit diff {self.max_logit_diff:.3g}")
        width = max([len(p.name) for p in rows] + [10])
        lines.append(f"{'hook point':<{width}}  {'max |b-a|':>10}  {'rel L2':>9}  "
                     f"{'cosine':>8}")
        lines += [f"{p.name:<{width}}  {p.max_abs:>10.3g}  {p.rel_l2:>9.3g}  {p.cosine:>8.5f}"
                  for p in rows]
        return "\n".join(lines)


def compare_runs(first: nn.Module, second: nn.Module, *args: Any, names: Any = None,
                 **kwargs: Any) -> RunComparison:
    """Run ``first`` and ``second`` on the same inputs and compare them point by point.

    Args:
        first: the reference model (a float32 model, say).
        second: the model compared with it (its quantized copy, say); the same hook names.
        *args, **kwargs: the models' inputs, as ``run_with_cache`` takes them (token ids,
            ``attention_mask=...``); an ``attention_mask`` also leaves padded positions out of
            the output statistics.
        names: which points to compare, as ``run_with_cache``'s ``names`` (None: all). The
            first model's kept activations are held until the second model reaches each
            point (one cache at a time, at most); a glob such as
            ``"blocks.*.hook_resid_post"`` keeps even that small.

    Returns:
        A :class:`RunComparison`.

    Raises:
        KeyError: for ``names`` matching no hook point of a model (as ``run_with_cache``).
    """
    with torch.inference_mode():
        kept: dict[str, Tensor] = {}  # the first model's activations, in the order they ran
        out_a = _run(first, args, kwargs, names, lambda t, name: kept.setdefault(name, t))
        points: list[PointDiff] = []
        mismatch, only_in_second, seen = [], [], set()

        def compare(b: Tensor, name: str) -> None:  # as the second model runs: one cache held
            if name in seen:
                return
            seen.add(name)
            a = kept.pop(name, None)  # (freed once compared: what stays is the first's own)
            if a is None:
                only_in_second.append(name)
            elif a.shape != b.shape:
                mismatch.append(name)
            else:
                points.append(_point(name, a, b))

        out_b = _run(second, args, kwargs, names, compare)
        outputs = _outputs(_logits(out_a), _logits(out_b), kwargs.get("attention_mask"))
    return RunComparison(
        points=tuple(points), top1_agreement=outputs[0], mean_kl=outputs[1],
        max_logit_diff=outputs[2], only_in_first=tuple(kept),
        only_in_second=tuple(only_in_second), shape_mismatch=tuple(mismatch))


def _run(model: nn.Module, args: tuple, kwargs: dict, names: Any,
         fn: Callable[[Tensor, str], object]) -> Any:
    """Run ``model`` with ``fn(activation, name)`` called at each chosen point as it runs
    (in the order they run: the order :meth:`RunComparison.first_divergence` follows; the
    hook order lists a block's ``hook_resid_post`` before its MLP's points)."""
    chosen = select_names(hook_points(model), names)

    def look(t: Tensor, name: str) -> None:
        fn(t.detach(), name)

    return run_with_hooks(model, *args, hooks={name: look for name in chosen}, **kwargs)


def _point(name: str, a: Tensor, b: Tensor) -> PointDiff:
    """One point's :class:`PointDiff` (see the module doc), in float64. Entries equal in both
    (masked scores at ``-inf`` included) differ by 0; an entry non-finite in one model only
    makes ``max_abs`` and ``rel_l2`` infinite."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    apart = bool(((a != b) & ~finite).any())  # inf or NaN in one model only
    a, b = torch.where(finite, a, 0.0), torch.where(finite, b, 0.0)
    diff = b - a
    norm_a, norm_d = float(a.norm()), float(diff.norm())
    rel = norm_d / norm_a if norm_a > 0 else (0.0 if norm_d == 0 else math.inf)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    if apart:
        rel = max_abs = math.inf
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    cosine = float(F.cosine_similarity(a, b, dim=-1, eps=1e-8).mean())
    per_head = None
    if name.rsplit(".", 1)[-1] in _HEADED and diff.dim() == 4:
        per_head = tuple(diff.abs().amax(dim=(0, 2, 3)).tolist())  # (H,)
    return PointDiff(name, tuple(a.shape), max_abs, rel, cosine, per_head)


def _logits(out: Any) -> Tensor | None:
    """The output's logits ``(B, L, V)`` (an output with ``.logits``, or a tensor), or None."""
    logits = getattr(out, "logits", out)
    return logits if isinstance(logits, Tensor) and logits.dim() == 3 else None


def _outputs(a: Tensor | None, b: Tensor | None, mask: Tensor | None
             ) -> tuple[float | None, float | None, float | None]:
    """Top-1 agreement, mean KL(a || b) and max |b - a| over the unmasked positions."""
    if a is None or b is None or a.shape != b.shape:
        return None, None, None
    a, b = a.double().flatten(0, 1), b.double().flatten(0, 1)  # (B, L, V) -> (B L, V)
    if mask is not None and mask.numel() == a.shape[0]:
        keep = mask.reshape(-1).bool()  # (B L,)
        a, b = a[keep], b[keep]
    if a.shape[0] == 0:
        return None, None, None
    top1 = float((a.argmax(-1) == b.argmax(-1)).double().mean())
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    kl = float(F.kl_div(log_b, log_a, log_target=True, reduction="none").sum(-1).mean())
    return top1, kl, float((b - a).abs().max())
