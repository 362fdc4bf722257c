"""Attribution patching: the first-order estimate of every activation patch at once.

:func:`~handformer.inspect.ablation.patching_sweep` runs the corrupted input once per patch
and measures ``metric(patched) - metric(corrupted)``. Near the corrupted run the metric is
close to linear in the activation ``a`` being patched, so (Nanda 2023; Syed et al. 2023)::

    metric(corrupted with a_clean[piece]) - metric(corrupted)
        ~=  sum over the piece of  (a_clean - a_corrupted) * d metric / d a |corrupted

One forward of the clean input (its activations), one forward of the corrupted input with
gradients on the activations, and one backward give the estimate of every patch of a sweep:
``(num_layers, heads)`` or ``(num_layers, L)``, the shape and the sign ``patching_sweep``
returns for the same arguments. The model's parameters get no gradients (their
``requires_grad`` is turned off for the call and restored).

The gradient at each hook point is taken through everything downstream of it: each
activation gets a zero tensor added (``a + delta``, ``delta`` requiring grad) and the
gradient with respect to ``delta`` is the total derivative.

Shape letters: ``N`` layers, ``B`` batch, ``L`` length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from handformer.inspect.ablation import (
    Inputs,
    _shape,
    check_pair,
    over_pairs,
    patch_target,
)
from handformer.inspect.points import hook_points, select_names
from handformer.inspect.run import _call, hooks

__all__ = ["attribution_patching"]


class _Enough(Exception):  # noqa: N818 - control flow, never seen outside this module
    """Raised by the last hook of the clean run: the rest of the forward is not needed."""


def _clean_activations(model: nn.Module, clean: Inputs, names: list[str]) -> dict[str, Tensor]:
    """The clean run's activations at ``names``; the forward stops once it has the last one
    (the layers after it and the unembedding are not computed)."""
    kept: dict[str, Tensor] = {}

    def keep(t: Tensor, name: str) -> None:
        kept[name] = t.detach()
        if len(kept) == len(names):
            raise _Enough

    try:
        with torch.no_grad(), hooks(model, dict.fromkeys(names, keep)):
            _call(model, (clean,), {})
    except _Enough:
        pass
    missing = [n for n in names if n not in kept]
    if missing:
        raise ValueError(f"the clean run never reached {missing[0]!r}")
    return kept


def attribution_patching(model: nn.Module, clean: Inputs | list[Inputs],
                         corrupted: Inputs | list[Inputs], metric: Callable[[Any], Tensor], *,
                         hook: str = "z", progress: bool | None = None,
                         prefix: str = "") -> Tensor:
    """The linear estimate of :func:`~handformer.inspect.ablation.patching_sweep`.

    Args:
        model: a handformer model (eval mode is the caller's choice; dropout would make the
            two forwards differ).
        clean: inputs of the clean run, or a list of them.
        corrupted: inputs of the corrupted run, of the same shapes (a list of the same length
            for a list: the mean over the pairs, shared among the ranks under ``torchrun``).
        metric: ``metric(output) -> scalar tensor``, differentiable (e.g. a logit difference).
        hook: what is patched, as for ``patching_sweep``: ``"z"``, ``"result"``, ``"q"``,
            ``"pattern"`` (per query head), ``"k"``, ``"v"`` (per key/value head),
            ``"resid_pre"``, ``"resid_mid"``, ``"resid_post"``, ``"attn_out"``,
            ``"mlp_out"`` (per position).
        progress: a progress bar over a list of prompts.
        prefix: the stack of an encoder-decoder model.

    Returns:
        float64 ``(num_layers, heads)`` or ``(num_layers, L)``.

    Raises:
        ValueError: for an unknown hook, inputs of different shapes, or a metric that does not
            return one number depending on the output.
    """
    where, dim = patch_target(hook)
    if isinstance(clean, list):
        return over_pairs(lambda c, x: attribution_patching(
            model, c, x, metric, hook=hook, progress=False, prefix=prefix),
            clean, corrupted, progress, "attribution patching")
    check_pair(clean, corrupted)
    N, _ = _shape(model, prefix)
    names = [f"{prefix}blocks.{layer}.{where}" for layer in range(N)]
    select_names(hook_points(model), names)  # a KeyError naming it if the model lacks it
    clean_acts = _clean_activations(model, clean, names)

    params = [p for p in model.parameters() if p.requires_grad]
    seen: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (corrupted activation, delta)

    def listen(t: Tensor, name: str) -> Tensor:
        delta = torch.zeros_like(t, requires_grad=True)
        seen[name] = (t.detach(), delta)
        return t + delta

    try:
        for p in params:
            p.requires_grad_(False)
        with torch.enable_grad(), hooks(model, dict.fromkeys(names, listen)):
            value = metric(_call(model, (corrupted,), {}))
        if not isinstance(value, Tensor) or value.numel() != 1 or not value.requires_grad:
            raise ValueError("attribution_patching needs metric(output) to return one number "
                             "as a tensor computed from the output (differentiable), got "
                             f"{type(value).__name__}"
                             + (f" of shape {tuple(value.shape)}" if isinstance(value, Tensor)
                                else ""))
        grads = torch.autograd.grad(value.reshape(()), [seen[n][1] for n in names],
                                    allow_unused=True)
    finally:
        for p in params:
            p.requires_grad_(True)
    rows = []
    for name, grad in zip(names, grads, strict=True):
        corrupt = seen[name][0]
        if grad is None:  # the metric does not depend on this activation
            rows.append(torch.zeros(corrupt.shape[dim], dtype=torch.float64))
            continue
        diff = clean_acts[name].double() - corrupt.double()
        effect = diff * grad.double()
        other = [d for d in range(effect.dim()) if d != dim]
        rows.append(effect.sum(other).cpu())  # (heads,) or (L,)
    return torch.stack(rows)  # (N, cols)
