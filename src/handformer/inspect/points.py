"""Hook-point names: one TransformerLens-style scheme for every model.

A model's hook points are the :class:`~handformer.hooks.HookPoint` modules inside it. Their
module paths are renamed by a few rules so that every model shows the same names:

========================================  ==========================================
module path                               hook name
========================================  ==========================================
``layers.{i}.`` (any stack)               ``blocks.{i}.``
``….self_attn.hook_q``                    ``….attn.hook_q``
``….ff.hook_pre``                         ``….mlp.hook_pre``
``hook_final_norm`` (a stack's final norm) ``ln_final.hook_normalized``
``norm.hook_scale`` (a stack's final norm) ``ln_final.hook_scale``
``….norm1.`` (pre-attention norm)          ``….ln1.``
``….norm3.`` (a decoder layer's pre-MLP)   ``….ln2.``
``….norm2.`` (an encoder layer's pre-MLP)  ``….ln2.``
``….norm2.`` (a decoder's cross-attention) ``….ln_cross.``
``….post_attn_norm.`` / ``post_mlp_norm.`` ``….ln1_post.`` / ``….ln2_post.``
BertModel ``embeddings.`` / ``encoder.``  (dropped: ``hook_embed``, ``blocks.0…``)
========================================  ==========================================

A norm's ``hook_scale`` is its divisor ``(B, L, 1)`` (``sqrt(var + eps)`` for LayerNorm,
``sqrt(mean(x^2) + eps)`` for RMSNorm), as TransformerLens' ``ln1.hook_scale``; the
QK-norms keep their names (``blocks.0.attn.q_norm.hook_scale``).

An encoder-decoder :class:`~handformer.Transformer` keeps its ``encoder.`` / ``decoder.``
prefixes (``decoder.blocks.0.cross_attn.hook_pattern``).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable

from torch import nn

from handformer.decoder_layer import DecoderLayer
from handformer.hooks import HookPoint
from handformer.layers import MultiHeadAttention
from handformer.pretrained.bert import BertModel

__all__ = ["hook_points", "hook_names", "select_names", "attention_layers", "NameSpec"]

NameSpec = str | Iterable[str] | Callable[[str], bool] | None

_RULES = (
    (re.compile(r"(^|\.)layers\.(\d+)\."), r"\1blocks.\2."),
    (re.compile(r"\.self_attn\."), ".attn."),
    (re.compile(r"\.ff\."), ".mlp."),
    (re.compile(r"(^|\.)hook_final_norm$"), r"\1ln_final.hook_normalized"),
)
_BERT_PREFIXES = ("embeddings.", "encoder.")
_LAYER_NORMS = re.compile(r"(^|.*\.)(norm[123]|post_attn_norm|post_mlp_norm)\.")
_FINAL_NORM = re.compile(r"^((?:encoder|decoder)\.)?norm\.")
_LAYER_NORM_NAMES = {"norm1": "ln1", "norm3": "ln2", "post_attn_norm": "ln1_post",
                     "post_mlp_norm": "ln2_post"}


def _norm_name(model: nn.Module, path: str) -> str:
    """Rename a norm's segment of ``path`` (``norm1`` -> ``ln1``, ...; see the table)."""
    match = _LAYER_NORMS.match(path)
    if match:
        owner, segment = match.group(1), match.group(2)
        if segment == "norm2":
            layer = model.get_submodule(owner.rstrip(".")) if owner else model
            new = "ln_cross" if isinstance(layer, DecoderLayer) else "ln2"
        else:
            new = _LAYER_NORM_NAMES[segment]
        return f"{owner}{new}.{path[match.end():]}"
    if not isinstance(model, BertModel):
        return _FINAL_NORM.sub(r"\1ln_final.", path)
    return path


def hook_name(model: nn.Module, path: str) -> str:
    """The hook name of the module at ``path`` inside ``model``."""
    path = _norm_name(model, path)
    if isinstance(model, BertModel):
        for prefix in _BERT_PREFIXES:
            if path.startswith(prefix):
                path = path[len(prefix):]
                break
    for pattern, repl in _RULES:
        path = pattern.sub(repl, path)
    return path


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of ``model``, by name, in the order the modules were built.

    Args:
        model: a handformer model.

    Raises:
        TypeError: if ``model`` is not a module or has no hook points.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    points = {hook_name(model, path): m for path, m in model.named_modules()
              if isinstance(m, HookPoint)}
    if not points:
        raise TypeError(f"{type(model).__name__} has no hook points; inspect works on "
                        "handformer modules (BertModel, CausalLM, Encoder, ...)")
    return points


def hook_names(model: nn.Module) -> list[str]:
    """The names of every hook point of ``model`` (see :func:`hook_points`).

    Args:
        model: a handformer model."""
    return list(hook_points(model))


def select_names(points: dict[str, HookPoint], names: NameSpec, *, what: str = "names"
                 ) -> list[str]:
    """The hook names a name spec selects.

    Args:
        points: from :func:`hook_points`.
        names: None (all), a name, a glob (``"blocks.*.hook_resid_post"``), a list of those,
            or a predicate ``name -> bool``.
        what: the argument's name, for error messages.

    Raises:
        KeyError: for a name or glob that matches no hook point (with the closest names).
        TypeError: for a spec of another type.
    """
    if names is None:
        return list(points)
    if callable(names):
        return [n for n in points if names(n)]
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Iterable):
        raise TypeError(f"{what} must be a name, a glob, a list of them or a predicate, got "
                        f"{type(names).__name__}")
    chosen: dict[str, None] = {}
    for spec in names:
        if not isinstance(spec, str):
            raise TypeError(f"{what} must hold strings, got {type(spec).__name__}")
        if any(c in spec for c in "*?["):
            matched = fnmatch.filter(points, spec)
        else:
            matched = [spec] if spec in points else []
        if not matched:
            raise KeyError(unknown_name_message(spec, points))
        chosen.update(dict.fromkeys(matched))
    return list(chosen)


def unknown_name_message(name: str, valid: Iterable[str]) -> str:
    """``unknown hook name 'x'; closest: a, b, c`` (or a hint to :func:`hook_names`)."""
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"closest: {', '.join(close)}" if close else f"valid names look like {valid[0]!r}"
    return f"unknown hook name {name!r}; {hint} (see handformer.inspect.hook_names(model))"


def attention_layers(model: nn.Module, prefix: str = "") -> list[MultiHeadAttention]:
    """The self-attention module of each block ``{prefix}blocks.{i}``, in layer order.

    Args:
        model: a handformer model.
        prefix: the stack of an encoder-decoder model (``"encoder."``, ``"decoder."``).

    Raises:
        ValueError: if the model has no such blocks.
    """
    found: dict[int, MultiHeadAttention] = {}
    pattern = re.compile(re.escape(prefix) + r"blocks\.(\d+)\.attn\.hook_z")
    for path, m in model.named_modules():
        if isinstance(m, MultiHeadAttention):
            match = pattern.fullmatch(hook_name(model, path + ".hook_z"))
            if match:
                found[int(match.group(1))] = m
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention blocks named "
                         f"{prefix}blocks.{{i}}.attn")
    return [found[i] for i in sorted(found)]
