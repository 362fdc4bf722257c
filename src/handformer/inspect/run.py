"""Run a model with hooks, or with an activation cache.

    out = run_with_hooks(model, ids, hooks={"blocks.0.attn.hook_z": fn})
    out, cache = run_with_cache(model, ids, names="blocks.*.hook_resid_post")
    with hooks(model, {"blocks.*.attn.hook_pattern": show}):
        model(ids)

Hooks are ``fn(tensor, name) -> Tensor | None`` (None = only look; a tensor of the same
shape and dtype replaces the value). They are active for that call or ``with`` block only,
in the calling thread or asyncio task only (see :mod:`handformer.hooks`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from handformer.hooks import HookFn, HookPoint, active_hooks
from handformer.inspect import attribution
from handformer.inspect.act_names import act_name, short_forms
from handformer.inspect.points import (
    NameSpec,
    hook_points,
    select_names,
    unknown_name_message,
)

__all__ = ["hooks", "run_with_hooks", "run_with_cache", "ActivationCache", "short_name"]

PosSlice = int | slice | Sequence[int] | Tensor | None
HookSpec = Mapping[str, HookFn | list[HookFn] | tuple[HookFn, ...]]


def short_name(short: str, layer: int | None = None, norm: str | None = None) -> str:
    """``("pattern", 3)`` -> ``"blocks.3.attn.hook_pattern"``; ``"embed"`` -> ``"hook_embed"``;
    ``("scale", 3, "ln1")`` -> ``"blocks.3.ln1.hook_scale"``; ``"scale"`` -> the final norm's.
    TransformerLens' ``get_act_name``: see :func:`handformer.inspect.act_names.act_name`.

    Args:
        short: the short name (TransformerLens': ``"pattern"``, ``"resid_post"``, ...).
        layer: the block (negative counts from the end only in a cache, which knows the
            number of layers); None for the names outside the blocks.
        norm: which norm of the block, for the norms' names (``"ln1"``, ``"ln2"``).

    Raises:
        KeyError: for a name or kind of the wrong type, or a kind that contradicts the name.
    """
    return act_name(short, layer, norm)


def _registry(model: nn.Module, spec: HookSpec) -> dict[HookPoint, tuple[tuple[str, HookFn], ...]]:
    """Hook point -> ((name, fn), ...) for a ``{name or glob: fn or [fns]}`` mapping."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"hooks must be a mapping {{name: fn}}, got {type(spec).__name__}")
    points = hook_points(model)
    registry: dict[HookPoint, tuple[tuple[str, HookFn], ...]] = {}
    for key, fns in spec.items():
        fns = tuple(fns) if isinstance(fns, (list, tuple)) else (fns,)
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"hook for {key!r} must be callable fn(tensor, name), got "
                                f"{type(fn).__name__}")
        for name in select_names(points, [key], what="hooks"):
            registry[points[name]] = registry.get(points[name], ()) + tuple(
                (name, fn) for fn in fns)
    return registry


@contextmanager
def hooks(model: nn.Module, spec: HookSpec) -> Iterator[None]:
    """Register hooks on ``model`` for the ``with`` block (this thread / task only).

    Args:
        model: a handformer model.
        spec: ``{name or glob: fn}`` or ``{name: [fn, ...]}``; ``fn(tensor, name)``.

    Raises:
        KeyError: for a name matching no hook point (the message lists the closest names).
        TypeError: for a hook that is not callable.
    """
    with active_hooks(_registry(model, spec)):
        yield


def _call(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``model(*args, **kwargs)``; a single mapping argument is spread as keywords (the
    tokenizer's output)."""
    if len(args) == 1 and isinstance(args[0], Mapping):
        return model(**args[0], **kwargs)
    return model(*args, **kwargs)


def run_with_hooks(model: nn.Module, *args: Any, hooks: HookSpec, **kwargs: Any) -> Any:
    """Run ``model(*args, **kwargs)`` with ``hooks`` active for this call only.

    Args:
        model: a handformer model.
        *args, **kwargs: the model's inputs (a single mapping, e.g. a tokenizer's output, is
            passed as keywords).
        hooks: ``{name or glob: fn}``; ``fn(tensor, name)`` returns None or a replacement of
            the same shape and dtype.

    Returns:
        The model's usual output.

    Raises:
        KeyError: for an unknown hook name. ``HookError`` (a ``ValueError``) when a hook
            returns a tensor of another shape or dtype (naming the hook and both shapes).
    """
    with active_hooks(_registry(model, hooks)):
        return _call(model, args, kwargs)


class ActivationCache(Mapping[str, Tensor]):
    """Activations by hook name, as :func:`run_with_cache` kept them; it knows its model.

    ``cache["blocks.0.attn.hook_pattern"]`` or, TransformerLens style,
    ``cache["pattern", 0]`` (negative layers count from the end: ``cache["pattern", -1]``),
    ``cache["scale", 0, "ln1"]``; :meth:`stack` stacks one name over the layers.

    Direct logit attribution (:mod:`handformer.inspect.attribution`, TransformerLens' names):
    :meth:`accumulated_resid`, :meth:`decompose_resid`, :meth:`stack_head_results`,
    :meth:`apply_ln_to_stack`, :meth:`logit_attrs`, :meth:`logit_bias`,
    :meth:`tokens_to_residual_directions`.

    Args:
        tensors: the kept activations by hook name.
        all_names: every hook name of the model (a name not kept is refused by name).
        model: the model that was run (None for a cache built by hand).

    Attributes:
        model: the model that was run (None for a cache built by hand).
        num_layers: the number of blocks ``blocks.{i}`` among the hook names.
    """

    def __init__(self, tensors: dict[str, Tensor], all_names: list[str],
                 model: nn.Module | None = None) -> None:
        self._tensors = tensors
        self._all_names = all_names
        self.model = model
        layers = [int(m.group(1)) for n in all_names
                  if (m := re.match(r"blocks\.(\d+)\.", n))]
        self.num_layers = max(layers) + 1 if layers else 0

    def _layer(self, layer: int) -> int:
        """A layer index with negative values counted from the end."""
        N = self.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not -N <= layer < N:
            raise KeyError(f"layer {layer!r} is out of range: the model has {N} "
                           f"layer{'s' * (N != 1)}, valid layers are 0..{N - 1} (or -{N}..-1)")
        return layer % N

    def __getitem__(self, key: str | tuple) -> Tensor:
        if isinstance(key, str) and key in self._tensors:
            return self._tensors[key]
        name = self._resolve(key)
        if name in self._tensors:
            return self._tensors[name]
        if name in self._all_names:
            raise KeyError(f"{name!r} was not kept: run_with_cache(..., names=...) left it out")
        if isinstance(key, str) and key == name:
            raise KeyError(unknown_name_message(name, self._all_names))
        hint = ""
        if f"blocks.0.{name.removeprefix('hook_')}" in self._all_names or \
                f"blocks.0.{name}" in self._all_names:
            hint = f" (a per-layer name: give the layer, e.g. cache[{key!r}, 0])"
        raise KeyError(f"{key!r} is {name!r}, which this model has not{hint}; its short names "
                       f"are {', '.join(short_forms(self._all_names))}")

    def _resolve(self, key: str | tuple) -> str:
        """The full hook name of a key: a name, a short name (``"embed"``, ``"k6"``) or a
        TransformerLens tuple ``(name, layer)`` / ``(name, layer, kind)``."""
        if isinstance(key, str):
            return key if key in self._all_names else act_name(key)
        if not isinstance(key, tuple) or not 1 <= len(key) <= 3:
            raise KeyError(f"a cache key is a hook name or (name, layer[, kind]), got {key!r}")
        if len(key) >= 2 and key[1] is not None:
            key = (key[0], self._layer(key[1]), *key[2:])
        return act_name(*key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def stack(self, short: str) -> Tensor:
        """One activation of every layer stacked: ``(num_layers, ...)``.

        Raises:
            KeyError: if the cache holds it for no layer.
        """
        import torch

        layers = []
        while act_name(short, len(layers)) in self._tensors:
            layers.append(self._tensors[act_name(short, len(layers))])
        if not layers:
            raise KeyError(f"the cache holds no {act_name(short, 0)!r} (names kept: "
                           f"{len(self)})")
        return torch.stack(layers)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} of {len(self._all_names)} hook points)"

    # ---- direct logit attribution (handformer.inspect.attribution) ----------------------

    def accumulated_resid(self, layer: int | None = None, *, incl_mid: bool = False,
                          apply_ln: bool = False, pos_slice: PosSlice = None,
                          mlp_input: bool = False, return_labels: bool = False) -> Any:
        """See :func:`handformer.inspect.attribution.accumulated_resid`."""
        return attribution.accumulated_resid(
            self, layer, incl_mid=incl_mid, apply_ln=apply_ln, pos_slice=pos_slice,
            mlp_input=mlp_input, return_labels=return_labels)

    def decompose_resid(self, layer: int | None = None, *, mlp_input: bool = False,
                        mode: str = "all", apply_ln: bool = False, pos_slice: PosSlice = None,
                        incl_embeds: bool = True, return_labels: bool = False) -> Any:
        """See :func:`handformer.inspect.attribution.decompose_resid`."""
        return attribution.decompose_resid(
            self, layer, mlp_input=mlp_input, mode=mode, apply_ln=apply_ln,
            pos_slice=pos_slice, incl_embeds=incl_embeds, return_labels=return_labels)

    def stack_head_results(self, layer: int | None = None, *, return_labels: bool = False,
                           incl_remainder: bool = False, pos_slice: PosSlice = None,
                           apply_ln: bool = False) -> Any:
        """See :func:`handformer.inspect.attribution.stack_head_results`."""
        return attribution.stack_head_results(
            self, layer, return_labels=return_labels, incl_remainder=incl_remainder,
            pos_slice=pos_slice, apply_ln=apply_ln)

    def apply_ln_to_stack(self, stack: Tensor, layer: int | None = None, *,
                          mlp_input: bool = False, pos_slice: PosSlice = None,
                          recompute: bool = False) -> Tensor:
        """See :func:`handformer.inspect.attribution.apply_ln_to_stack`."""
        return attribution.apply_ln_to_stack(self, stack, layer, mlp_input=mlp_input,
                                             pos_slice=pos_slice, recompute=recompute)

    def logit_attrs(self, stack: Any, tokens: Any, incorrect_tokens: Any = None,
                    pos_slice: PosSlice = None, *, incl_bias: bool = False) -> Any:
        """See :func:`handformer.inspect.attribution.logit_attrs`."""
        return attribution.logit_attrs(self, stack, tokens, incorrect_tokens, pos_slice,
                                       incl_bias=incl_bias)

    def logit_bias(self, tokens: Any, incorrect_tokens: Any = None,
                   pos_slice: PosSlice = None) -> Tensor:
        """See :func:`handformer.inspect.attribution.logit_bias`."""
        return attribution.logit_bias(self, tokens, incorrect_tokens, pos_slice)

    def tokens_to_residual_directions(self, tokens: Any) -> Tensor:
        """See :func:`handformer.inspect.attribution.tokens_to_residual_directions`."""
        return attribution.tokens_to_residual_directions(self.model, tokens)


def _backward(out: Any, incl_bwd: bool | Callable[[Any], Tensor], live: dict[str, Tensor]
              ) -> dict[str, Tensor]:
    """The gradients of the scalar ``incl_bwd`` names at the ``live`` tensors (see
    :func:`run_with_cache`); the parameters' ``.grad`` are left alone."""
    if callable(incl_bwd):
        scalar = incl_bwd(out)
    elif isinstance(out, Tensor):
        scalar = out
    else:
        scalar = getattr(out, "loss", None)
    if not isinstance(scalar, Tensor) or scalar.numel() != 1 or not scalar.requires_grad:
        raise ValueError("incl_bwd=True needs a scalar to differentiate: pass labels (the "
                         "output's loss), or incl_bwd=fn(output) -> scalar tensor")
    grads = torch.autograd.grad(scalar, list(live.values()), allow_unused=True)
    return {n: torch.zeros_like(t) if g is None else g
            for (n, t), g in zip(live.items(), grads, strict=True)}


def run_with_cache(model: nn.Module, *args: Any, names: NameSpec = None, detach: bool = True,
                   incl_bwd: bool | Callable[[Any], Tensor] = False,
                   **kwargs: Any) -> tuple[Any, ActivationCache]:
    """Run the model and keep the activations at the chosen hook points.

    Only the chosen points listen, so memory grows with what is kept. Keeping
    ``hook_attn_scores`` or ``hook_pattern`` makes those layers attend by the explicit path
    (as ``need_weights=True`` does for full attention).

    Args:
        model: a handformer model.
        *args, **kwargs: the model's inputs (a single mapping is passed as keywords).
        names: which points to keep: None (all), a name, a glob
            (``"blocks.*.hook_resid_post"``), a list of those, or a predicate ``name -> bool``.
        detach: store detached tensors (default); False keeps them in the autograd graph.
        incl_bwd: also keep the gradient at every kept point, as ``name + "_grad"``
            (TransformerLens' keys): True differentiates the output's ``loss`` (pass
            ``labels``) or the output itself when it is a scalar; a function
            ``fn(output) -> scalar`` differentiates what it returns (``lambda out:
            out.logits[0, -1, token]``).

    Returns:
        ``(output, cache)``: the model's usual output and an :class:`ActivationCache`.

    Raises:
        KeyError: for a name or glob that matches no hook point (with the closest names).
        ValueError: with ``incl_bwd=True`` and no scalar to differentiate.
    """
    points = hook_points(model)
    chosen = select_names(points, names)
    store: dict[str, Tensor] = {}
    live: dict[str, Tensor] = {}  # with incl_bwd: the kept tensors, in the autograd graph

    def keep(t: Tensor, name: str) -> None:
        store[name] = t.detach() if detach else t
        if incl_bwd is not False and t.requires_grad:
            live[name] = t

    registry: dict[HookPoint, tuple[tuple[str, Callable], ...]] = {
        points[n]: ((n, keep),) for n in chosen}
    with torch.enable_grad() if incl_bwd is not False else nullcontext(), \
            active_hooks(registry):
        out = _call(model, args, kwargs)
    if incl_bwd is not False:
        store.update({n + "_grad": g for n, g in _backward(out, incl_bwd, live).items()})
    ordered = {n: store[n] for n in chosen if n in store}
    ordered.update({n + "_grad": store[n + "_grad"] for n in chosen if n + "_grad" in store})
    return out, ActivationCache(ordered, list(points), model)
