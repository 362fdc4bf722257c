"""Splicing: a dictionary stands in for the activation it reads, inside the model.

    with attach(model, sae, at="blocks.6.hook_resid_post"):
        out, cache = run_with_cache(model, ids)
    cache["blocks.6.hook_resid_post.hook_sae_acts_post"]  # (B, L, d_sae) feature activations

    handle = attach(model, transcoders)  # permanent, every layer: a list of dictionaries
    ...
    handle.remove()                      # (or detach(model): every splice of the model)

**What changes.** The hook point named by ``at`` is swapped for a :class:`SplicePoint`: it runs
the hooks that listen there (they see the model's own value), then the dictionary, whose
result goes on instead: the reconstruction ``x̂`` plus the error term ``x − x̂`` (with
``with_error=True``, the default: the model's output is unchanged, exactly) or the
reconstruction alone (``with_error=False``: what the model computes through the dictionary).
The dictionary's hook points appear under ``at``
(``blocks.6.hook_resid_post.hook_sae_acts_post``), so :func:`~handformer.inspect.run_with_cache`,
:func:`~handformer.inspect.run_with_hooks` and the ablation and patching code read and edit
features with their usual API: zeroing ``acts[..., f]`` in a hook removes exactly feature
``f``'s contribution ``acts[f] · W_dec[f]`` from the model's activation (see
:meth:`~handformer.features.Dictionary.replace`).

**Transcoders** read one point and replace another: ``at=(input, output)``; ``at="blocks.6.mlp"``
means ``("blocks.6.mlp.hook_in", "blocks.6.hook_mlp_out")``: the MLP's input (after its pre-norm)
and the MLP sublayer's output as added to the residual (after a post-MLP norm, where the model
has one). Their features appear under the output point. Two points exist only while something
is spliced there: ``blocks.{i}.mlp.hook_in`` (the MLP module's input; TransformerLens /
circuit-tracer call it ``ln2.hook_normalized`` or ``mlp.hook_in``, accepted as aliases) and
``blocks.{i}.mlp.hook_out`` (the MLP module's output, before a post-MLP norm); handformer adds
them to the MLP module as hook points, called by PyTorch forward hooks on it.

The swap is a change of the model's modules (every thread sees it) and leaves its parameters
and ``state_dict`` alone (the dictionary is not registered as a submodule). While anything is
spliced, ``generate`` takes the modules' path (the plain decoding step would skip the splice).
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from handformer.features.dictionary import HOOKS, Dictionary, Transcoder
from handformer.hooks import HookPoint
from handformer.inspect.points import hook_name, hook_points, unknown_name_message

__all__ = ["attach", "detach", "Splice", "SplicePoint", "TapPoint", "splices", "resolve_at"]

_MLP_POINT = re.compile(r"^(?P<block>(?:.*\.)?blocks\.\d+)\.(?:mlp\.hook_(?P<io>in|out)"
                        r"|ln2\.hook_(?P<ln>normalized))$")
_MLP_SHORT = re.compile(r"^(?P<block>(?:.*\.)?blocks\.\d+)\.mlp$")


class _Slot(threading.local):
    """The transcoder's input, from its input point to its output point (per thread)."""

    value: Tensor | None = None


class TapPoint(HookPoint):
    """A hook point that also hands its value to a transcoder spliced further on.

    Attributes:
        name: the hook name.
    """

    def __init__(self, name: str, slot: _Slot, replaced: HookPoint | None) -> None:
        super().__init__()
        self.name = name
        object.__setattr__(self, "_slot", slot)  # plain attributes: not submodules
        object.__setattr__(self, "_replaced", replaced)

    def __call__(self, x: Tensor) -> Tensor:
        if self._replaced is not None:
            x = self._replaced(x)  # hooks registered on the original point keep running
        x = HookPoint.__call__(self, x)
        self._slot.value = x
        return x


class SplicePoint(HookPoint):
    """A hook point whose value is replaced by a dictionary's output (see the module docs).

    Its children are the dictionary's hook points (``hook_sae_acts_post``, ...), so their hook
    names are this point's name plus theirs.

    Attributes:
        name: the hook name.
        dictionary: the spliced dictionary (not a registered submodule).
        with_error: add the error term.
    """

    def __init__(self, name: str, dictionary: Dictionary, *, with_error: bool,
                 replaced: HookPoint | None, source: _Slot | None,
                 source_name: str | None) -> None:
        super().__init__()
        self.name = name
        self.with_error = with_error
        object.__setattr__(self, "dictionary", dictionary)
        object.__setattr__(self, "_replaced", replaced)
        object.__setattr__(self, "_source", source)
        self.source_name = source_name
        for hook in HOOKS:
            self.add_module(hook, getattr(dictionary, hook))

    def _observed(self) -> bool:
        """True when a hook listens on one of the dictionary's hook points."""
        d = self.dictionary
        return any(getattr(d, hook).listening() for hook in HOOKS)

    def __call__(self, x: Tensor) -> Tensor:
        if self._replaced is not None:
            x = self._replaced(x)
        x = HookPoint.__call__(self, x)
        d = self.dictionary
        if self._source is None:
            inp = x
        else:
            inp, self._source.value = self._source.value, None
            if inp is None:
                raise RuntimeError(f"the transcoder spliced at {self.name!r} found no input: "
                                   f"{self.source_name!r} did not run before it in this "
                                   "forward pass")
        if inp.shape[-1] != d.d_in:
            where = self.name if self._source is None else self.source_name
            raise ValueError(f"{type(d).__name__} with d_in = {d.d_in} does not fit "
                             f"{where!r}, whose activations are {tuple(inp.shape)}")
        if x.shape[-1] != d.d_out:
            raise ValueError(f"{type(d).__name__} with d_out = {d.d_out} does not fit "
                             f"{self.name!r}, whose activations are {tuple(x.shape)}")
        if self.with_error and not self._observed():
            return x  # = reconstruction + error, and nothing looks at the features
        out = d.replace(inp, x if self.with_error else None)
        return out if out.dtype == x.dtype else out.to(x.dtype)


class Splice:
    """What :func:`attach` did to a model, undone by :meth:`remove` (or at the end of a
    ``with`` block).

    Args:
        model: the model the splice belongs to.

    Attributes:
        points: hook name -> the :class:`SplicePoint` or :class:`TapPoint` installed there.
        dictionaries: hook name of the output point -> its dictionary.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.points: dict[str, HookPoint] = {}
        self.dictionaries: dict[str, Dictionary] = {}
        self._undo: list[Any] = []
        self.removed = False

    def remove(self) -> None:
        """Put the model's own hook points back (idempotent)."""
        if self.removed:
            return
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for d in self.dictionaries.values():
            _ATTACHED.discard(d)
        self.removed = True

    def names(self) -> list[str]:
        """The hook names of every feature point this splice added (``….hook_sae_acts_post``
        and the others)."""
        return [f"{at}.{hook}" for at in self.dictionaries for hook in HOOKS]

    def __enter__(self) -> Splice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"Splice({state}: {', '.join(self.dictionaries) or 'nothing'})"


# The dictionaries spliced somewhere (one dictionary, one place: its hook points are its own).
_ATTACHED: weakref.WeakSet[Dictionary] = weakref.WeakSet()


def splices(model: nn.Module) -> list[Splice]:
    """The active splices of ``model`` (found from the points they installed).

    Args:
        model: a model :func:`attach` may have spliced.

    Returns:
        The :class:`Splice` handles not yet removed.
    """
    found: dict[int, Splice] = {}
    for module in model.modules():
        splice = getattr(module, "splice", None)
        if isinstance(module, (SplicePoint, TapPoint)) and isinstance(splice, Splice):
            found.setdefault(id(splice), splice)
    return [s for s in found.values() if not s.removed]


def detach(model: nn.Module) -> int:
    """Remove every splice of ``model``.

    Args:
        model: a model :func:`attach` may have spliced.

    Returns:
        How many splices were removed.
    """
    active = splices(model)
    for splice in active:
        splice.remove()
    return len(active)


def resolve_at(dictionary: Dictionary, at: str | Sequence[str] | None) -> tuple[str | None, str]:
    """``(input point or None, output point)`` where ``dictionary`` is spliced.

    An SAE reads and replaces one point (``at`` or its ``hook_name``); a transcoder reads
    ``at[0]`` and replaces ``at[1]`` (``"blocks.6.mlp"``: the MLP sublayer; default its
    ``hook_name`` and ``output_hook_name``).

    Raises:
        ValueError: when no point is known, ``at`` has the wrong form, or it differs from the
            hook the dictionary says it was trained on.
    """
    kind = type(dictionary).__name__
    if isinstance(dictionary, Transcoder):
        if at is None:
            if dictionary.hook_name is None or dictionary.output_hook_name is None:
                raise ValueError(f"at is needed: this {kind} has no hook_name / "
                                 "output_hook_name (pass at='blocks.6.mlp' or at=(input hook, "
                                 "output hook))")
            return _canonical(dictionary.hook_name), _canonical(dictionary.output_hook_name)
        if isinstance(at, str):
            short = _MLP_SHORT.match(at)
            if not short:
                raise ValueError(f"at for a Transcoder must be 'blocks.{{i}}.mlp' or a pair "
                                 f"(input hook, output hook), got {at!r}")
            pair = (f"{short['block']}.mlp.hook_in", f"{short['block']}.hook_mlp_out")
        elif (isinstance(at, Sequence) and len(at) == 2
              and all(isinstance(a, str) for a in at)):
            pair = (_canonical(at[0]), _canonical(at[1]))
        else:
            raise ValueError(f"at for a Transcoder must be 'blocks.{{i}}.mlp' or a pair "
                             f"(input hook, output hook), got {at!r}")
        _check_trained_on(dictionary, "hook_name", dictionary.hook_name, pair[0])
        _check_trained_on(dictionary, "output_hook_name", dictionary.output_hook_name, pair[1])
        return pair
    if at is None:
        if dictionary.hook_name is None:
            raise ValueError(f"at is needed: this {kind} has no hook_name (pass "
                             "at='blocks.6.hook_resid_post')")
        return None, _canonical(dictionary.hook_name)
    if not isinstance(at, str):
        raise ValueError(f"at for a {kind} must be a hook name, got {at!r}")
    _check_trained_on(dictionary, "hook_name", dictionary.hook_name, _canonical(at))
    return None, _canonical(at)


def _canonical(name: str) -> str:
    """``blocks.6.ln2.hook_normalized`` -> ``blocks.6.mlp.hook_in`` (the MLP's input)."""
    match = _MLP_POINT.match(name)
    if match and match["ln"]:
        return f"{match['block']}.mlp.hook_in"
    return name


def _check_trained_on(d: Dictionary, field: str, trained: str | None, at: str) -> None:
    if trained is not None and _canonical(trained) != at:
        raise ValueError(f"{type(d).__name__} was trained on {trained!r} ({field}) but at "
                         f"asks for {at!r}; to splice it elsewhere anyway, set "
                         f"dictionary.{field} = None first")


def _items(dictionary: Any, at: Any) -> list[tuple[Dictionary, Any]]:
    if isinstance(dictionary, Dictionary):
        return [(dictionary, at)]
    if isinstance(dictionary, Mapping):
        if at is not None:
            raise ValueError("at must be None when dictionary is a mapping {at: dictionary}")
        items = [(d, a) for a, d in dictionary.items()]
    elif isinstance(dictionary, Iterable) and not isinstance(dictionary, (str, bytes)):
        if at is not None:
            raise ValueError("at must be None for a list of dictionaries (each is spliced at "
                             "its own hook_name)")
        items = [(d, None) for d in dictionary]
    else:
        raise TypeError(f"dictionary must be a SparseAutoencoder, a Transcoder, a list of them "
                        f"or a mapping {{at: dictionary}}, got {type(dictionary).__name__}")
    for d, _ in items:
        if not isinstance(d, Dictionary):
            raise TypeError(f"dictionaries must be SparseAutoencoder or Transcoder modules, "
                            f"got {type(d).__name__}")
    if not items:
        raise ValueError("no dictionary to attach (an empty list)")
    return items


class _Places:
    """Where each hook name of a model lives: ``(parent module, attribute)``; the MLP points
    ``blocks.{i}.mlp.hook_in`` / ``hook_out`` map to ``(MLP module, "hook_in")``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.points = hook_points(model)
        self.width = getattr(getattr(model, "config", None), "d_model", None)
        self.paths: dict[str, tuple[nn.Module, str]] = {}
        self.mlps: dict[str, nn.Module] = {}
        for path, module in model.named_modules():
            for attr, child in module.named_children():
                if isinstance(child, HookPoint):
                    full = f"{path}.{attr}" if path else attr
                    self.paths[hook_name(model, full)] = (module, attr)
            if path and hasattr(module, "hook_pre") and path.rsplit(".", 1)[-1] == "mlp":
                self.mlps[hook_name(model, path + ".hook_in").rsplit(".", 1)[0]] = module

    def lookup(self, name: str) -> tuple[nn.Module, str, bool]:
        """``(parent, attribute, virtual)`` of a hook name (virtual: an MLP point that exists
        only while spliced)."""
        match = _MLP_POINT.match(name)
        if match and match["io"] and name not in self.paths:
            mlp = self.mlps.get(f"{match['block']}.mlp")
            if mlp is None:
                raise KeyError(f"{name!r}: the model has no MLP {match['block']}.mlp")
            return mlp, f"hook_{match['io']}", True
        if name not in self.paths:
            raise KeyError(unknown_name_message(name, self.points))
        parent, attr = self.paths[name]
        return parent, attr, False


def attach(model: nn.Module, dictionary: Any, at: str | Sequence[str] | None = None, *,
           with_error: bool = True) -> Splice:
    """Splice one or several dictionaries into ``model`` (see the module docs).

    Args:
        model: a handformer model.
        dictionary: a :class:`SparseAutoencoder` or :class:`Transcoder`; a list of them (each
            at its own ``hook_name``); or a mapping ``{at: dictionary}``.
        at: where: a hook name for an SAE (default its ``hook_name``); for a transcoder
            ``"blocks.{i}.mlp"`` or ``(input hook, output hook)`` (default its ``hook_name``
            and ``output_hook_name``).
        with_error: add the error term ``x − x̂`` (the model's output stays as it was); False
            runs the model on the reconstruction.

    Returns:
        A :class:`Splice`: permanent until ``.remove()``; as a context manager, removed at the
        end of the ``with`` block.

    Raises:
        KeyError: for a hook name the model does not have (with the closest names).
        ValueError: a dictionary whose width does not fit the hook (naming both), a point
            already spliced, the same dictionary twice, ``at`` different from the hook the
            dictionary was trained on.
        TypeError: for something that is not a dictionary.
    """
    if not isinstance(with_error, bool):
        raise ValueError(f"with_error must be True or False, got {with_error!r}")
    items = _items(dictionary, at)
    places = _Places(model)
    plan: list[tuple[Dictionary, str | None, str]] = []
    seen: set[int] = set()
    used: set[str] = set()
    for d, where in items:
        if id(d) in seen or d in _ATTACHED:
            raise ValueError(f"this {type(d).__name__} is spliced already (one dictionary, one "
                             "place: its hook points would be shared); attach a copy "
                             "(copy.deepcopy) to splice it twice")
        seen.add(id(d))
        source, target = resolve_at(d, where)
        for name, width, role in ((source, d.d_in, "d_in"),
                                  (target, d.d_in if source is None else d.d_out,
                                   "d_in" if source is None else "d_out")):
            if name is None:
                continue
            parent, attr, _ = places.lookup(name)
            if isinstance(getattr(parent, attr, None), (SplicePoint, TapPoint)) or name in used:
                raise ValueError(f"{name!r} has a dictionary spliced already; remove that "
                                 "splice first (Splice.remove() or detach(model))")
            used.add(name)
            expected = _expected_width(places, name)
            if expected is not None and width != expected:
                raise ValueError(f"{type(d).__name__} with {role} = {width} does not fit "
                                 f"{name!r} of this model (width {expected})")
        plan.append((d, source, target))

    splice = Splice(model)
    try:
        for d, source, target in plan:
            slot = None
            if source is not None:
                slot = _Slot()
                _install(splice, places, source, lambda rep, s=source, sl=slot:
                         TapPoint(s, sl, rep))
            _install(splice, places, target, lambda rep, t=target, sl=slot, s=source, d=d:
                     SplicePoint(t, d, with_error=with_error, replaced=rep, source=sl,
                                 source_name=s))
            splice.dictionaries[target] = d
            _ATTACHED.add(d)
    except BaseException:
        splice.remove()
        raise
    return splice


def _expected_width(places: _Places, name: str) -> int | None:
    """The model width where a hook carries residual-width vectors (else unknown: None)."""
    tail = name.rsplit(".", 1)[-1]
    if places.width is None:
        return None
    if tail in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out",
                "hook_mlp_out", "hook_embed") or _MLP_POINT.match(name):
        return int(places.width)
    return None


def _install(splice: Splice, places: _Places, name: str, make: Any) -> None:
    """Put the point ``make(replaced)`` at ``name``; record how to undo it."""
    parent, attr, virtual = places.lookup(name)
    if not virtual:
        original = getattr(parent, attr)
        point = make(original)
        setattr(parent, attr, point)  # same key in parent._modules: order kept
        splice._undo.append(lambda: setattr(parent, attr, original))
    else:
        point = make(None)
        parent.add_module(attr, point)
        if attr == "hook_in":
            handle = parent.register_forward_pre_hook(
                lambda module, args, p=point: (p(args[0]), *args[1:]))
        else:
            handle = parent.register_forward_hook(lambda module, args, out, p=point: p(out))

        def undo(parent: nn.Module = parent, attr: str = attr, handle: Any = handle) -> None:
            handle.remove()
            delattr(parent, attr)
        splice._undo.append(undo)
    object.__setattr__(point, "splice", splice)  # a plain attribute: detach(model) finds it
    splice.points[name] = point
