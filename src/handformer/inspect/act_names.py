"""Short hook names, as TransformerLens' ``utils.get_act_name`` spells them.

    act_name("pattern", 3)            -> "blocks.3.attn.hook_pattern"
    act_name("pattern", 3, "attn")    -> "blocks.3.attn.hook_pattern"   (the kind agrees)
    act_name("resid_post", 3)         -> "blocks.3.hook_resid_post"
    act_name("scale", 2, "ln1")       -> "blocks.2.ln1.hook_scale"
    act_name("scale")                 -> "ln_final.hook_scale"
    act_name("embed")                 -> "hook_embed"
    act_name("k6"), act_name("scale4ln1")  -> "blocks.6.attn.hook_k", "blocks.4.ln1.hook_scale"

The rules are TransformerLens': the attention names (``q k v z rot_q rot_k result pattern
attn_scores``) live under ``attn.``, the MLP names (``pre post mid pre_linear``) under
``mlp.``; any other name goes under the kind given (``"a"``/``"attention"`` = ``attn``,
``"m"`` = ``mlp``, ``"b"``/``"block"``/``"blocks"`` = the block itself, a norm such as
``"ln1"`` as it is), or under the block when none is given. Aliases: ``attn`` = ``pattern``,
``attn_logits`` = ``attn_scores``, ``query``/``key``/``value`` = ``q``/``k``/``v``,
``mlp_pre``/``mlp_mid``/``mlp_post`` = ``pre``/``mid``/``post``. A full name (with a dot, or
starting ``hook_``) passes through. Where TransformerLens silently ignores a kind that
contradicts the name (``("pattern", 0, "mlp")``), this refuses it.

:func:`short_forms` goes the other way, from a model's hook names to the short forms that
reach them: what an error lists as valid is exactly what resolves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["act_name", "short_forms", "ATTN_NAMES", "MLP_NAMES"]

ATTN_NAMES = ("q", "k", "v", "z", "rot_q", "rot_k", "result", "pattern", "attn_scores")
MLP_NAMES = ("pre", "post", "mid", "pre_linear")
_NAME_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q",
                 "value": "v", "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_KIND_ALIASES = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "",
                 "blocks": ""}
_NORM_NAMES = ("scale", "normalized")
_COMPACT = re.compile(r"([a-z]+)(\d+)([a-z]?.*)")  # "k6", "scale4ln1" (TransformerLens')
_FULL = re.compile(r"blocks\.(\d+)\.(?:(\w+)\.)?hook_(\w+)")


def _kind(kind: str | None) -> str | None:
    """A kind with TransformerLens' aliases resolved (``"a"`` -> ``"attn"``)."""
    return None if kind is None else _KIND_ALIASES.get(kind, kind)


def act_name(name: str, layer: int | None = None, kind: str | None = None) -> str:
    """The full hook name of a TransformerLens short name.

    Args:
        name: ``"pattern"``, ``"resid_post"``, ``"scale"``... (or a full name, returned as
            it is, or a compact ``"k6"`` / ``"scale4ln1"``).
        layer: the block (None: a model-level name such as ``"embed"``).
        kind: what in the block holds it: ``"attn"``, ``"mlp"``, ``"ln1"``, ``"ln2"``...
            (optional where the name says it).

    Returns:
        ``"blocks.{layer}.{kind}.hook_{name}"`` and its relatives (see the module docstring).

    Raises:
        KeyError: for a name or kind that is not a string, a layer that is not an integer,
            or a kind that contradicts an attention or MLP name.
    """
    if not isinstance(name, str) or (kind is not None and not isinstance(kind, str)):
        raise KeyError(f"a short hook name is (name, layer, kind) with a str name and kind, "
                       f"got {(name, layer, kind)!r}")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise KeyError(f"the layer of a short hook name must be an integer, got {layer!r}")
    if ("." in name or name.startswith("hook_")) and layer is None and kind is None:
        return name
    if name == "ln_final" and layer is None and kind is None:
        return "ln_final.hook_normalized"
    compact = _COMPACT.fullmatch(name) if layer is None and kind is None else None
    if compact:
        name, layer, kind = compact.group(1), int(compact.group(2)), compact.group(3) or None
    name = _NAME_ALIASES.get(name, name)
    given = _kind(kind)
    if name in ATTN_NAMES or name in MLP_NAMES:
        own = "attn" if name in ATTN_NAMES else "mlp"
        allowed = (None, own, "cross_attn") if own == "attn" else (None, own)
        if given not in allowed:
            raise KeyError(f"{name!r} is an {own} hook (blocks.{{i}}.{own}.hook_{name}); the "
                           f"kind {kind!r} names another part of the block")
        given = given or own
    if layer is None:
        if name in _NORM_NAMES and not given:
            return f"ln_final.hook_{name}"
        return f"{given}.hook_{name}" if given else f"hook_{name}"
    return f"blocks.{layer}.{given}.hook_{name}" if given else f"blocks.{layer}.hook_{name}"


def short_forms(names: Iterable[str]) -> list[str]:
    """The short forms that reach ``names`` (a model's hook names), one per kind of name.

    ``blocks.3.attn.hook_pattern`` gives ``('pattern', layer)``, ``blocks.3.ln1.hook_scale``
    gives ``('scale', layer, 'ln1')``, ``ln_final.hook_scale`` gives ``'scale'``; a name no
    short form reaches (``blocks.0.attn.q_norm.hook_scale``, an encoder-decoder's
    ``encoder.`` names) gives none. Each form is written as it is typed.
    """
    forms: dict[str, None] = {}
    for full in names:
        match = _FULL.fullmatch(full)
        if match:
            layer, kind, short = int(match.group(1)), match.group(2), match.group(3)
            if act_name(short, layer) == full:
                forms[f"({short!r}, layer)"] = None
            elif kind and _safe_act_name(short, layer, kind) == full:
                forms[f"({short!r}, layer, {kind!r})"] = None
            continue
        short = full.removeprefix("ln_final.").removeprefix("hook_")
        if "." not in short and act_name(short) == full:
            forms[repr(short)] = None
    return list(forms)


def _safe_act_name(name: str, layer: int, kind: str) -> str | None:
    try:
        return act_name(name, layer, kind)
    except KeyError:
        return None
