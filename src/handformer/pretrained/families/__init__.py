"""One small module per checkpoint family: its ``config.json`` mapping and its key map.

Each family module holds:

* ``config_from_hf(hf: dict) -> CausalLMConfig``: the ``config.json`` dict as handformer's
  config, every feature an explicit field (never switched on by the family's name in the
  model); what handformer does not implement is refused in one line naming the field;
* ``key_map(config) -> {hf_key: our_key}``: every checkpoint tensor the config implies, in
  the family's canonical spelling (``model.layers.0.self_attn.q_proj.weight``), mapped to
  :class:`~handformer.CausalLM`'s state-dict key (a value may be a list of ``(key,
  transform)`` pairs where the layouts differ, as GPT-2's fused ``c_attn``);
* ``LAYOUT``: the prefixes a file may spell those keys with, and keys skipped on purpose;
* ``GGUF``: the family's llama.cpp files -- their ``general.architecture`` values and the
  fix-ups llama.cpp's converter made (:class:`.common.GGUFRules`). Which tensors a GGUF file
  holds follows from ``config_from_hf``, as for a folder.

The documentation page "Adding a family" (``docs/adding-a-family.md``) walks through writing one.

:func:`family_for` finds the family of a ``model_type``; the shared strict loader is
:func:`handformer.pretrained.lm.build_causal_lm`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from handformer.pretrained.families import gemma, gpt2, llama, qwen
from handformer.pretrained.families.common import ConfigFieldError, GGUFRules, Layout

__all__ = ["Family", "FAMILIES", "GGUF_FAMILIES", "family_for", "gguf_family_for",
           "supported_model_types", "ConfigFieldError", "GGUFRules", "HANDFORMER_TYPE"]

HANDFORMER_TYPE = "handformer-causal-lm"  # a handformer train run / CausalLM.save_pretrained


@dataclass(frozen=True)
class Family:
    """A checkpoint family.

    Attributes:
        name: the family module's name (``llama``, ``qwen``, ``gemma``, ``gpt2``).
        model_types: the ``model_type`` values it reads.
        config_from_hf: ``config.json`` dict -> :class:`~handformer.CausalLMConfig`.
        key_map: config -> ``{canonical hf key: handformer key or [(key, transform)]}``.
        layout: the file spellings of those keys (:class:`.common.Layout`).
        file_shapes: config -> ``{canonical hf key: shape}`` where key map transforms change
            shapes (GPT-2); None where every key keeps the model's shape.
        gguf: its GGUF architectures and llama.cpp's fix-ups (:class:`.common.GGUFRules`).
    """

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict], object]
    key_map: Callable[[object], dict]
    layout: Layout
    file_shapes: Callable[[object], dict] | None = None
    gguf: GGUFRules | None = None


def _family(module: ModuleType) -> Family:
    return Family(module.__name__.rsplit(".", 1)[-1], module.MODEL_TYPES,
                  module.config_from_hf, module.key_map, module.LAYOUT,
                  getattr(module, "file_shapes", None), getattr(module, "GGUF", None))


FAMILIES: dict[str, Family] = {
    model_type: family
    for family in map(_family, (gpt2, llama, qwen, gemma))
    for model_type in family.model_types
}

# GGUF general.architecture -> its family
GGUF_FAMILIES: dict[str, Family] = {
    arch: family
    for family in dict.fromkeys(FAMILIES.values()) if family.gguf is not None
    for arch in family.gguf.architectures
}


def supported_model_types() -> list[str]:
    """Every ``model_type`` :func:`~handformer.pretrained.load_lm` reads, in one list."""
    return [*FAMILIES, HANDFORMER_TYPE]


def family_for(model_type: object) -> Family:
    """The family of ``model_type``.

    Args:
        model_type: a ``config.json``'s ``model_type`` value.

    Raises:
        ValueError: for a ``model_type`` no family reads (the message names the supported
            ones).
    """
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not a causal LM handformer reads; "
                         f"supported: {', '.join(supported_model_types())}")
    return family


def gguf_family_for(architecture: str) -> Family:
    """The family of a GGUF file's ``general.architecture``.

    Args:
        architecture: the file's ``general.architecture`` value.

    Raises:
        ValueError: for an architecture no family reads (the message names the supported
            ones).
    """
    family = GGUF_FAMILIES.get(architecture)
    if family is None:
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; supported "
                         f"architectures: {', '.join(sorted(GGUF_FAMILIES))}")
    return family
