"""Hook-point names: one TransformerLens-style scheme for every model.

A model's hook points are the :class:`~handformer.hooks.HookPoint` modules inside it, and a
hook point's name is its module path: ``cache["blocks.3.attn.hook_pattern"]`` is what
``model.blocks[3].attn.hook_pattern`` sees. There are no renaming rules; the names are the
modules' own (TransformerLens' names, which handformer's modules carry). Module, its hook
points, and the Hugging Face key it loads from (Llama; GPT-2 / BERT in brackets)::

    blocks.{i}            hook_resid_pre, hook_attn_out,     model.layers.{i}
                          hook_resid_mid, hook_mlp_in,       [transformer.h.{i},
                          hook_mlp_out, hook_resid_post      encoder.layer.{i}]
    blocks.{i}.ln1        ln1.hook_scale, ln1.hook_normalized  input_layernorm  [ln_1]
    blocks.{i}.attn       attn.hook_q ... attn.hook_pattern,   self_attn
                          attn.hook_z, attn.hook_result
    blocks.{i}.ln2        ln2.hook_scale, ln2.hook_normalized  post_attention_layernorm
                          (ln2's output: what the MLP reads)   [ln_2]; Gemma:
                                                               pre_feedforward_layernorm
    blocks.{i}.mlp        mlp.hook_pre, mlp.hook_post          mlp
    blocks.{i}.ln1_post   ln1_post.hook_normalized             Gemma post_attention_layernorm
    blocks.{i}.ln2_post   ln2_post.hook_normalized             Gemma post_feedforward_layernorm
    blocks.{i}.ln_cross   ln_cross.hook_normalized; then       (encoder-decoder only)
      and .cross_attn     cross_attn.hook_pattern ...
    ln_final              ln_final.hook_scale,                 model.norm  [ln_f]
                          ln_final.hook_normalized
    (the model)           hook_embed, hook_pos_embed           embed_tokens  [wte, wpe]
                          (BERT: hook_token_type_embed)

(:class:`~handformer.DecoderLayer`'s docstring has the block's table in full.) A norm's
``hook_scale`` is its divisor ``(B, L, 1)`` (``sqrt(var + eps)`` for LayerNorm,
``sqrt(mean(x^2) + eps)`` for RMSNorm), as TransformerLens' ``ln1.hook_scale``; its
``hook_normalized`` its output. The QK-norms have both too (``blocks.0.attn.q_norm.
hook_scale``).

An encoder-decoder :class:`~handformer.Transformer` has its ``encoder.`` / ``decoder.``
prefixes (``decoder.blocks.0.cross_attn.hook_pattern``). Module names from before (``layers``,
``self_attn``, ``norm1``...): :mod:`handformer.legacy_names`.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable

from torch import nn

from handformer.hooks import HookPoint
from handformer.layers import MultiHeadAttention

__all__ = ["hook_points", "hook_names", "hook_name", "select_names", "attention_layers",
           "NameSpec"]

NameSpec = str | Iterable[str] | Callable[[str], bool] | None


def hook_name(model: nn.Module, path: str) -> str:
    """The hook name of the module at ``path`` inside ``model``: ``path`` itself (kept for
    callers of the renaming this replaced)."""
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
    points = {path: m for path, m in model.named_modules() if isinstance(m, HookPoint)}
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
            match = pattern.fullmatch(path + ".hook_z")
            if match:
                found[int(match.group(1))] = m
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention blocks named "
                         f"{prefix}blocks.{{i}}.attn")
    return [found[i] for i in sorted(found)]
