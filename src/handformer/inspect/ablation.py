"""Head ablation and activation patching, one (layer, head) or position at a time.

A sweep runs the model once per edit: ablate head ``(l, h)`` (zero it, or set it to its mean
output), or patch one activation of a clean run into a corrupted run. It returns, for every
edit, the change of a metric the caller passes: ``metric(edited output) - metric(baseline)``.
Edits are batched: the inputs are repeated ``batch_size`` times along the batch dim and each
copy gets its own edit, so one forward answers many edits (the numbers are the same as one
edit at a time, up to float rounding).

Shape letters: ``B`` batch of the inputs, ``R`` copies per forward, ``L`` length, ``H``
heads, ``D`` head dim, ``N`` layers.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from handformer.hooks import HookFn
from handformer.inspect.points import attention_layers, hook_points, select_names
from handformer.inspect.run import _call, hooks, run_with_cache

__all__ = ["head_ablation_hooks", "head_means", "head_ablation_sweep", "patching_sweep",
           "patch_target", "over_pairs"]

Inputs = Tensor | Mapping[str, Tensor]
Metric = Callable[[Any], Tensor | float]
Edit = tuple[str, Callable[[Tensor], Tensor]]  # (hook name, rows of one copy -> new rows)
MODES = ("zero", "mean")


def _shape(model: nn.Module, prefix: str) -> tuple[int, int]:
    """``(num_layers, num_heads)`` of the blocks under ``prefix``."""
    layers = attention_layers(model, prefix)
    return len(layers), layers[0].num_heads


def _check_heads(heads: Iterable[tuple[int, int]], N: int, H: int) -> list[tuple[int, int]]:
    checked = []
    for item in heads:
        if (not isinstance(item, (tuple, list)) or len(item) != 2
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in item)):
            raise TypeError(f"heads must be (layer, head) pairs of ints, got {item!r}")
        layer, head = item
        if not 0 <= layer < N:
            raise ValueError(f"layer {layer} is out of range: the model has layers 0..{N - 1}")
        if not 0 <= head < H:
            raise ValueError(f"head {head} is out of range: each layer has heads 0..{H - 1}")
        checked.append((layer, head))
    return checked


def _check_mode(mode: str, means: Tensor | None, N: int, H: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "mean":
        if means is None:
            raise ValueError("mode='mean' needs means: pass head_means(model, reference_inputs)")
        if means.dim() != 3 or tuple(means.shape[:2]) != (N, H):
            raise ValueError(f"means must be (num_layers, num_heads, head_dim) = ({N}, {H}, D), "
                             f"got {tuple(means.shape)}")


def _ablate(rows: Tensor, head: int, mode: str, mean: Tensor | None) -> Tensor:
    """``rows`` ``(B, L, H, D)`` with one head zeroed or set to its mean ``(D,)``."""
    rows = rows.clone()
    rows[:, :, head] = 0.0 if mode == "zero" else mean.to(rows.dtype)
    return rows


def head_ablation_hooks(model: nn.Module, heads: Iterable[tuple[int, int]], *,
                        mode: str = "zero", means: Tensor | None = None,
                        prefix: str = "") -> dict[str, HookFn]:
    """Hooks that ablate some heads, for :func:`~handformer.inspect.run_with_hooks` /
    :func:`~handformer.inspect.hooks`.

    A head is ablated at ``blocks.{l}.attn.hook_z``, its output before ``out_proj``: zero
    (``mode="zero"``) or its mean output over reference inputs (``mode="mean"``,
    ``means`` from :func:`head_means`). ``out_proj``'s bias belongs to no head and stays.

    Args:
        model: a handformer model.
        heads: ``(layer, head)`` pairs.
        mode: ``"zero"`` or ``"mean"``.
        means: ``(num_layers, num_heads, head_dim)`` for ``mode="mean"``.
        prefix: the stack of an encoder-decoder model (``"encoder."``, ``"decoder."``).

    Returns:
        ``{hook name: fn}``.

    Raises:
        ValueError: for a layer or head out of range (naming the valid range), an unknown
            mode, or missing / mis-shaped means.
    """
    N, H = _shape(model, prefix)
    _check_mode(mode, means, N, H)
    by_layer: dict[int, list[int]] = {}
    for layer, head in _check_heads(heads, N, H):
        by_layer.setdefault(layer, []).append(head)

    def make(layer: int, heads_here: list[int]) -> HookFn:
        def hook(z: Tensor, name: str) -> Tensor:
            for head in heads_here:
                z = _ablate(z, head, mode, None if means is None else means[layer, head])
            return z
        return hook

    return {f"{prefix}blocks.{layer}.attn.hook_z": make(layer, hs)
            for layer, hs in by_layer.items()}


def head_means(model: nn.Module, inputs: Inputs, *, prefix: str = "") -> Tensor:
    """Each head's mean output ``(num_layers, num_heads, head_dim)`` over ``inputs``
    (over every real token: positions where ``attention_mask`` is 0 are left out).

    Args:
        model: a handformer model.
        inputs: the model's inputs, as :func:`head_ablation_sweep` takes them.
        prefix: the stack of an encoder-decoder model.
    """
    N, _ = _shape(model, prefix)
    with torch.no_grad():
        _, cache = run_with_cache(model, inputs, names=f"{prefix}blocks.*.attn.hook_z")
    keep = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    means = []
    for layer in range(N):
        z = cache[f"{prefix}blocks.{layer}.attn.hook_z"]  # (B, L, H, D)
        w = (torch.ones(z.shape[:2], device=z.device) if keep is None
             else keep.to(z.device, z.dtype))  # (B, L)
        means.append((z * w[..., None, None]).sum((0, 1)) / w.sum())  # (H, D)
    return torch.stack(means)  # (N, H, D)


def _batch_size_of(inputs: Inputs) -> int:
    tensors = list(inputs.values()) if isinstance(inputs, Mapping) else [inputs]
    if not tensors or not all(isinstance(t, Tensor) and t.dim() >= 1 for t in tensors):
        raise TypeError("inputs must be a tensor (e.g. input_ids) or a mapping of tensors (a "
                        "tokenizer's output)")
    return tensors[0].shape[0]


def _repeat(inputs: Inputs, R: int) -> Inputs:
    """Each input tensor repeated ``R`` times along the batch: ``(B, ...)`` -> ``(R*B, ...)``."""
    def rep(t: Tensor) -> Tensor:
        return t.repeat(R, *([1] * (t.dim() - 1)))  # (R*B, ...)
    if isinstance(inputs, Mapping):
        return {k: rep(v) for k, v in inputs.items()}
    return rep(inputs)


def _rows(out: Any, rows: slice, total: int) -> Any:
    """The part of a model output that belongs to batch rows ``rows`` (of ``total``)."""
    if isinstance(out, Tensor):
        return out[rows] if out.dim() and out.shape[0] == total else out
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(o, rows, total) for o in out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{
            f.name: _rows(getattr(out, f.name), rows, total) for f in dataclasses.fields(out)
            if isinstance(getattr(out, f.name), (Tensor, tuple, list))})
    return out


def _metric_value(metric: Metric, out: Any) -> float:
    if not callable(metric):
        raise TypeError(f"metric must be a function output -> number, got "
                        f"{type(metric).__name__}")
    value = metric(out)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric must return one number, got a tensor of shape "
                             f"{tuple(value.shape)}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise TypeError(f"metric must return one number (a float or a one-element tensor), "
                        f"got {type(value).__name__} {shown}; e.g. metric=lambda out: "
                        "out.logits[0, -1, token_id]")
    return float(value)


def _sweep(model: nn.Module, inputs: Inputs, metric: Metric, edits: Sequence[Edit], *,
           batch_size: int, progress: bool | None, desc: str) -> list[float]:
    """``metric`` of the output of ``inputs`` with each edit applied (batched copies)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    B = _batch_size_of(inputs)
    show = (len(edits) > 4 * batch_size and sys.stderr.isatty()) if progress is None \
        else progress
    values: list[float] = []
    with torch.no_grad(), tqdm(total=len(edits), desc=desc, disable=not show) as bar:
        for start in range(0, len(edits), batch_size):
            chunk = edits[start:start + batch_size]
            R = len(chunk)
            by_name: dict[str, list[tuple[int, Callable[[Tensor], Tensor]]]] = {}
            for j, (name, fn) in enumerate(chunk):
                by_name.setdefault(name, []).append((j, fn))

            def make(todo: list[tuple[int, Callable[[Tensor], Tensor]]]) -> HookFn:
                def hook(t: Tensor, name: str) -> Tensor:  # t: (R*B, ...)
                    t = t.clone()
                    for j, fn in todo:
                        t[j * B:(j + 1) * B] = fn(t[j * B:(j + 1) * B])
                    return t
                return hook

            with hooks(model, {name: make(todo) for name, todo in by_name.items()}):
                out = _call(model, (_repeat(inputs, R),), {})
            values += [_metric_value(metric, _rows(out, slice(j * B, (j + 1) * B), R * B))
                       for j in range(R)]
            bar.update(R)
    return values


def head_ablation_sweep(model: nn.Module, inputs: Inputs, metric: Metric, *,
                        mode: str = "zero", means: Tensor | None = None,
                        heads: Iterable[tuple[int, int]] | None = None, batch_size: int = 16,
                        progress: bool | None = None, prefix: str = "") -> Tensor:
    """The change of ``metric`` when each head is ablated alone.

    Args:
        model: a handformer model (eval mode is the caller's choice).
        inputs: the model's inputs: ``input_ids`` ``(B, L)`` or a tokenizer's output; or a
            list of them (one prompt each): the result is the mean over the prompts, shared
            among the ranks under ``torchrun``.
        metric: ``metric(output) -> number`` (e.g. the cosine of two embeddings, a logit
            difference), computed on the output of ``inputs`` alone.
        mode: ``"zero"`` or ``"mean"`` (then ``means`` from :func:`head_means`).
        means: each head's mean output ``(num_layers, num_heads, head_dim)`` for
            ``mode="mean"`` (:func:`head_means`).
        heads: only these ``(layer, head)`` pairs (default every head; the others are NaN).
        batch_size: ablations per forward pass.
        progress: a progress bar (default: when the sweep is long and stderr is a terminal).
        prefix: the stack of an encoder-decoder model.

    Returns:
        ``(num_layers, num_heads)`` float64: ``metric(ablated) - metric(clean)``.

    Raises:
        ValueError: for heads or layers out of range, a bad mode, ``batch_size`` or a metric
            that does not return one number.
    """
    if isinstance(inputs, list):
        return over_pairs(lambda x: head_ablation_sweep(
            model, x, metric, mode=mode, means=means, heads=heads, batch_size=batch_size,
            progress=False, prefix=prefix), inputs, None, progress, "ablating heads")
    N, H = _shape(model, prefix)
    _check_mode(mode, means, N, H)
    todo = (_check_heads(heads, N, H) if heads is not None
            else [(layer, h) for layer in range(N) for h in range(H)])
    edits: list[Edit] = [
        (f"{prefix}blocks.{layer}.attn.hook_z",
         lambda rows, h=h, m=(None if means is None else means[layer, h]):
             _ablate(rows, h, mode, m))
        for layer, h in todo]
    with torch.no_grad():
        clean = _metric_value(metric, _call(model, (inputs,), {}))
    values = _sweep(model, inputs, metric, edits, batch_size=batch_size, progress=progress,
                    desc="ablating heads")
    result = torch.full((N, H), float("nan"), dtype=torch.float64)
    for (layer, h), v in zip(todo, values, strict=True):
        result[layer, h] = v - clean
    return result


# What patching_sweep / attribution_patching patch, per short hook name: the hook point under
# ``blocks.{l}.``, the dim that is patched one index at a time (heads or positions) and what
# those indices are.
HEAD_HOOKS = {"z": ("attn.hook_z", 2), "result": ("attn.hook_result", 2),
              "q": ("attn.hook_q", 1), "k": ("attn.hook_k", 1), "v": ("attn.hook_v", 1),
              "pattern": ("attn.hook_pattern", 1)}
POSITION_HOOKS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def patch_target(hook: str) -> tuple[str, int]:
    """``(hook point under blocks.{l}., patched dim)`` of a short hook name.

    Raises:
        ValueError: for an unknown name.
    """
    if hook in HEAD_HOOKS:
        return HEAD_HOOKS[hook]
    if hook in POSITION_HOOKS:
        return f"hook_{hook}", 1
    raise ValueError(f"hook must be one of {tuple(HEAD_HOOKS) + POSITION_HOOKS}, got {hook!r}")


def check_pair(clean: Inputs, corrupted: Inputs) -> None:
    """Clean and corrupted inputs must have the same shapes."""
    shapes = [{k: tuple(v.shape) for k, v in x.items()} if isinstance(x, Mapping)
              else tuple(x.shape) for x in (clean, corrupted)]
    if shapes[0] != shapes[1]:
        raise ValueError(f"clean and corrupted inputs must have the same shapes (one "
                         f"activation replaces the other), got {shapes[0]} and {shapes[1]}")


def patching_sweep(model: nn.Module, clean: Inputs | list[Inputs],
                   corrupted: Inputs | list[Inputs], metric: Metric, *, hook: str = "z",
                   batch_size: int = 16, progress: bool | None = None,
                   prefix: str = "") -> Tensor:
    """Activation patching: the change of ``metric`` on the corrupted run when one piece of
    the clean run's activations is put in its place.

    Per head, ``(num_layers, heads)``: ``hook="z"`` (a query head's output before
    ``out_proj``), ``"result"`` (its output in model space), ``"q"`` and ``"pattern"`` (per
    query head), ``"k"`` and ``"v"`` (per key/value head: with grouped-query attention
    ``(num_layers, num_kv_heads)``, and patching one KV head changes every query head that
    shares it). Per position, ``(num_layers, L)``: a residual-stream hook (``"resid_pre"``,
    ``"resid_mid"``, ``"resid_post"``, ``"attn_out"``, ``"mlp_out"``) patches one position
    at a time. Patching a query head (``z``, ``q``, ``pattern``, ``result``) leaves the KV
    head the other query heads share as it is.

    Args:
        model: a handformer model.
        clean: inputs of the clean run, or a list of them (one prompt each).
        corrupted: inputs of the corrupted run, of the same shapes (a list of the same
            length for a list: the result is the mean over the pairs, shared among the ranks
            under ``torchrun``).
        metric: ``metric(output) -> number``.
        hook: which activation to patch (short name, see above).
        batch_size: patches per forward pass.
        progress: a progress bar (default: for long sweeps on a terminal).
        prefix: the stack of an encoder-decoder model.

    Returns:
        float64 tensor of ``metric(patched corrupted run) - metric(corrupted run)``.

    Raises:
        ValueError: for inputs of different shapes or an unknown ``hook``.
    """
    where, dim = patch_target(hook)
    if isinstance(clean, list):
        return over_pairs(lambda c, x: patching_sweep(
            model, c, x, metric, hook=hook, batch_size=batch_size, progress=False,
            prefix=prefix), clean, corrupted, progress, "patching")
    check_pair(clean, corrupted)
    N, _ = _shape(model, prefix)
    pattern = f"{prefix}blocks.*.{where}"
    select_names(hook_points(model), pattern)  # a KeyError naming it if the model lacks it
    with torch.no_grad():
        _, cache = run_with_cache(model, clean, names=pattern)
        base = _metric_value(metric, _call(model, (corrupted,), {}))
    cols = next(iter(cache.values())).shape[dim]

    def patch(rows: Tensor, source: Tensor, col: int) -> Tensor:
        rows = rows.clone()
        index = (slice(None),) * dim + (col,)
        rows[index] = source[index]  # one head (or position) of every sequence
        return rows

    edits: list[Edit] = []
    for layer in range(N):
        name = f"{prefix}blocks.{layer}.{where}"
        edits += [(name, lambda rows, s=cache[name], c=c: patch(rows, s, c))
                  for c in range(cols)]
    values = _sweep(model, corrupted, metric, edits, batch_size=batch_size,
                    progress=progress, desc="patching")
    return torch.tensor(values, dtype=torch.float64).reshape(N, cols) - base  # (N, cols)


def over_pairs(run: Callable[..., Tensor], first: list, second: list | None,
               progress: bool | None, desc: str) -> Tensor:
    """The mean of ``run(a)`` (or ``run(a, b)``) over a list of prompts (pairs), each rank
    of a ``torchrun`` job taking its share (see :mod:`handformer.inspect.shares`).

    Raises:
        ValueError: for an empty list, or two lists of different lengths.
    """
    from handformer.inspect.shares import my_share, progress_bar, reduce_sum

    if not first:
        raise ValueError("the list of prompts is empty")
    if second is not None and (not isinstance(second, list) or len(second) != len(first)):
        got = len(second) if isinstance(second, list) else type(second).__name__
        raise ValueError(f"clean and corrupted must be lists of the same length for a sweep "
                         f"over prompts, got {len(first)} and {got}")
    items = list(first) if second is None else list(zip(first, second, strict=True))
    total: Tensor | None = None
    mine = my_share(items)
    with progress_bar(len(mine), desc, progress) as bar:
        for _, item in mine:
            value = run(item) if second is None else run(*item)
            total = value.double() if total is None else total + value.double()
            bar.update(1)
    if total is None:  # more ranks than prompts: this rank measured nothing
        value = run(items[0]) if second is None else run(*items[0])
        total = torch.zeros_like(value, dtype=torch.float64)
    return reduce_sum(total) / len(items)
