"""The module names before "one name per part", and the one key map from them to today's.

Until 0.x a module's path was not its hook name: ``layers.0.self_attn`` was renamed by rules
into ``blocks.0.attn``. Now the path *is* the hook name (as in TransformerLens). Each class
that renamed a child lists the old name beside the new one in ``LEGACY_NAMES``:

=======================================  ====================================================
class                                    old name -> new name
=======================================  ====================================================
``CausalLM``, ``Encoder``, ``Decoder``   ``layers`` -> ``blocks``, ``norm`` -> ``ln_final``
``DecoderLayer``                         ``self_attn`` -> ``attn``, ``ff`` -> ``mlp``,
                                         ``norm1`` -> ``ln1``, ``norm3`` -> ``ln2``,
                                         ``norm2`` -> ``ln_cross``, ``post_attn_norm`` ->
                                         ``ln1_post``, ``post_mlp_norm`` -> ``ln2_post``
``EncoderLayer``                         ``self_attn`` -> ``attn``, ``ff`` -> ``mlp``,
                                         ``norm1`` -> ``ln1``, ``norm2`` -> ``ln2``
``BertModel``                            ``encoder.layers`` -> ``blocks`` (its files hold
                                         Hugging Face's names, which did not change)
=======================================  ====================================================

That one table does three things:

* **loading**: :func:`legacy_key_map` turns a state dict's old keys into today's (a
  ``decoder.layers.0.norm2.weight`` of an encoder-decoder model is its
  ``decoder.blocks.0.ln_cross.weight``); :func:`handformer.weights.load_safetensors` applies
  it to folders written by ``CausalLM.save_pretrained`` and ``handformer train`` before the
  rename, and ``module.load_state_dict`` renames old keys too (each class renames its own
  children's, as torch's modules upgrade their old state dicts);
* **old attribute names** (``model.layers``, ``layer.self_attn``, ``layer.ff``...) still
  read and assign the renamed module, with a :class:`DeprecationWarning`, for one release;
  nothing is registered twice (``named_modules`` and ``state_dict`` show the new names only);
* the table above is its documentation.

This module imports nothing of handformer.
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from typing import Any, ClassVar

from torch import nn

__all__ = ["LegacyNames", "legacy_key_map"]

_REMOVED_IN = "the release after next"


def _warn(owner: object, old: str, new: str) -> None:
    warnings.warn(f"{type(owner).__name__}.{old} is now .{new} (one name per part: the module "
                  f"path is the hook name); .{old} goes away in {_REMOVED_IN}",
                  DeprecationWarning, stacklevel=3)


class _Renamed:
    """A class attribute standing for an old child name: reading it warns and returns the
    child under its new name (a descriptor: nothing is registered under the old name)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        _warn(obj, self.old, self.new)
        return getattr(obj, self.new)


class LegacyNames:
    """Mixin of the modules that renamed children: old names read, assign and load.

    A class sets ``LEGACY_NAMES`` (old child name -> new child name; a dotted old name, as
    BertModel's ``encoder.layers``, only renames state-dict keys).
    """

    LEGACY_NAMES: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in cls.__dict__.get("LEGACY_NAMES", {}).items():
            if "." not in old:
                setattr(cls, old, _Renamed(old, new))

    def __setattr__(self, name: str, value: Any) -> None:
        new = type(self).LEGACY_NAMES.get(name)
        if new is not None:
            _warn(self, name, new)
            name = new
        super().__setattr__(name, value)

    def _load_from_state_dict(self, state_dict: MutableMapping[str, Any], prefix: str,
                              *args: Any, **kwargs: Any) -> None:
        rename_keys(state_dict, prefix, type(self).LEGACY_NAMES)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]


def rename_keys(state_dict: MutableMapping[str, Any], prefix: str, names: dict[str, str]
                ) -> None:
    """Rename, in place, ``{prefix}{old}.…`` keys to ``{prefix}{new}.…`` (order kept)."""
    if not names:
        return
    starts = {f"{prefix}{old}.": f"{prefix}{new}." for old, new in names.items()}
    if not any(k.startswith(s) for k in state_dict for s in starts):
        return
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        for start, new_start in starts.items():
            if key.startswith(start):
                key = new_start + key[len(start):]
                break
        state_dict[key] = value


def _old_path(model: nn.Module, key: str) -> str:
    """The old name of the state-dict key ``key`` (today's name) of ``model``."""
    module: nn.Module | None = model
    parts = key.split(".")
    old: list[str] = []
    for part in parts[:-1]:
        inverse = {new: o for o, new in getattr(type(module), "LEGACY_NAMES", {}).items()}
        old.append(inverse.get(part, part))
        module = module._modules.get(part) if module is not None else None
    return ".".join([*old, parts[-1]])


def legacy_key_map(model: nn.Module) -> dict[str, str]:
    """Old state-dict key -> today's, for every key of ``model`` whose name changed.

    Args:
        model: a handformer module (keys of modules without ``LEGACY_NAMES`` keep their name).

    Returns:
        ``{old key: new key}`` (empty when no name changed), e.g. ``layers.0.self_attn.
        q_proj.weight`` -> ``blocks.0.attn.q_proj.weight``; a mapping key map for
        :func:`~handformer.weights.load_safetensors`.
    """
    out = {}
    for key in model.state_dict(keep_vars=True):
        old = _old_path(model, key)
        if old != key:
            out[old] = key
    return out
