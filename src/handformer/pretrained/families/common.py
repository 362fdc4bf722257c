"""What the families' ``config.json`` files share, read in one place.

A Hugging Face ``config.json`` names the same idea in several ways, depending on the family and
on the transformers version that wrote it:

* RoPE: current files carry ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling
  fields; Gemma 3 nests one such dict per layer type, ``{"sliding_attention": {...},
  "full_attention": {...}}``); older ones carry ``rope_theta``, ``rope_scaling`` and (Gemma 3)
  ``rope_local_base_freq``. :func:`rope_for` reads both.
* the activation is ``hidden_act``, or ``hidden_activation`` in Gemma's configs
  (:func:`activation`);
* sliding-window layers: ``layer_types`` (``"full_attention"`` / ``"sliding_attention"`` per
  layer) where the file has it, else each family's rule (Gemma 2 alternates, starting with a
  sliding layer; Gemma 3 has ``sliding_window_pattern``; Qwen uses ``use_sliding_window`` and
  ``max_window_layers``; Mistral slides everywhere) -- the family passes its fallback to
  :func:`layer_types`. A Hugging Face window ``W`` lets query ``i`` see keys
  ``i - W < j <= i``: that is handformer's causal ``LocalAttention`` with
  ``window_size = 2 W - 1`` (:func:`window_size`).

Every refusal is a :class:`ConfigFieldError` (a ``ValueError``) whose one line names the field
and its value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["ConfigFieldError", "Fields", "Layout", "GGUFRules", "activation", "rope_for",
           "layer_types", "window_size", "ACTIVATIONS", "ROPE_TYPES", "LAYER_TYPES"]

# Hugging Face activation names -> handformer's (the gated MLP's ``act(gate) * up``)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu"}
ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "local"}
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")


class ConfigFieldError(ValueError):
    """A ``config.json`` field handformer cannot honour: unknown, unsupported or inconsistent."""


@dataclass
class Fields:
    """A family's ``config.json`` with that family's defaults under it.

    transformers writes every field, but files saved by older versions (and the text part of a
    Gemma 3 checkpoint) leave out those at their class default; ``defaults`` holds those
    values, so a field the file omits reads as transformers would read it.

    Args:
        data: the ``config.json`` dict.
        defaults: the family's class defaults.
        source: how errors name the config (its ``model_type``).
    """

    data: Mapping[str, object]
    defaults: Mapping[str, object] = field(default_factory=dict)
    source: str = "config.json"

    def __contains__(self, name: str) -> bool:
        return name in self.data and self.data[name] is not None

    def get(self, name: str, default: object = None) -> object:
        """The field's value: the file's, else the family default, else ``default``."""
        if name in self.data:
            return self.data[name]
        return self.defaults.get(name, default)

    def refuse(self, name: str, value: object, why: str) -> ConfigFieldError:
        """The one-line error for field ``name``."""
        return ConfigFieldError(f"{self.source} config field {name}={value!r}: {why}")

    def int(self, name: str, *, minimum: int = 1) -> int:
        """A required integer field ``>= minimum``."""
        value = self.get(name)
        if value is None and name not in self.data and name not in self.defaults:
            raise ConfigFieldError(f"{self.source} config.json lacks the field {name!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.refuse(name, value, f"must be an integer >= {minimum}")
        return value

    def number(self, name: str, *, positive: bool = True) -> float | None:
        """A finite number (``> 0`` when ``positive``), or None when the field is null."""
        value = self.get(name)
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or (positive and value <= 0)):
            raise self.refuse(name, value, "must be a positive finite number" if positive
                              else "must be a finite number")
        return float(value)

    def flag(self, name: str) -> bool:
        """A boolean field (null reads as False)."""
        value = self.get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self.refuse(name, value, "must be true or false")
        return value


def activation(f: Fields, *names: str) -> str:
    """handformer's activation name from the first of ``names`` the config sets.

    Raises:
        ConfigFieldError: for an activation handformer does not implement.
    """
    for name in names:
        value = f.get(name)
        if value is None:
            continue
        if value not in ACTIVATIONS:
            raise f.refuse(name, value, f"activation not supported; supported: "
                                        f"{sorted(ACTIVATIONS)}")
        return ACTIVATIONS[value]  # type: ignore[index]
    raise ConfigFieldError(f"{f.source} config.json sets none of {list(names)} (the "
                           "activation)")


def _scaling(f: Fields, where: str, params: Mapping[str, object]) -> dict | None:
    """The RoPE scaling dict handformer's config takes, from one rope dict (None: unscaled)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise f.refuse(f"{where}.rope_type", kind, f"RoPE type not supported; supported: "
                                                   f"{list(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise f.refuse(f"{where}.partial_rotary_factor", partial,
                       "partial rotary embeddings are not supported (only 1.0)")
    if kind == "default":
        return None
    names = ("factor",) if kind == "linear" else LLAMA3_FIELDS
    out: dict[str, object] = {"rope_type": kind}
    for name in names:
        value = params.get(name)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise f.refuse(f"{where}.{name}", value, f"RoPE type {kind!r} needs a positive "
                                                     "number here")
        out[name] = int(value) if name == "original_max_position_embeddings" else float(value)
    return out


def rope_for(f: Fields, layer_type: str | None = None, *, default_theta: float = 10000.0,
             legacy_theta: str = "rope_theta", legacy_scaled: bool = True
             ) -> tuple[float, dict | None]:
    """RoPE base and scaling of one layer type.

    Args:
        f: the config.
        layer_type: ``"full_attention"`` or ``"sliding_attention"`` when the file may nest
            ``rope_parameters`` per layer type (Gemma 3); None for one set for all layers.
        default_theta: the base when the file gives none.
        legacy_theta: the old field holding this layer type's base (Gemma 3's sliding layers:
            ``rope_local_base_freq``).
        legacy_scaled: whether the old ``rope_scaling`` applies to this layer type (Gemma 3:
            only to full-attention layers).

    Returns:
        ``(theta, scaling)``: scaling None, ``{"rope_type": "linear", "factor": f}`` or
        llama3's four fields.

    Raises:
        ConfigFieldError: for an unknown RoPE type, missing scaling fields, partial rotary
            factors, or a base that is not a number > 1.
    """
    params = f.get("rope_parameters")
    where = "rope_parameters"
    if isinstance(params, Mapping) and ("full_attention" in params
                                        or "sliding_attention" in params):
        if layer_type is None:
            raise f.refuse("rope_parameters", dict(params), "per-layer-type RoPE parameters "
                           "are only read for Gemma 3")
        where = f"rope_parameters.{layer_type}"
        params = params.get(layer_type)
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", f.get(legacy_theta, default_theta))
        scaling = _scaling(f, where, params)
    elif params is None:
        theta = f.get(legacy_theta, default_theta)
        where = legacy_theta
        old = f.get("rope_scaling") if legacy_scaled else None
        if old is not None and not isinstance(old, Mapping):
            raise f.refuse("rope_scaling", old, "must be a JSON object or null")
        scaling = None if old is None else _scaling(f, "rope_scaling", old)
        if old is not None and "rope_theta" in old:
            theta = old["rope_theta"]
    else:
        raise f.refuse(where, params, "must be a JSON object or null")
    if (isinstance(theta, bool) or not isinstance(theta, (int, float))
            or not math.isfinite(theta) or theta <= 1):
        raise f.refuse(f"{where}.rope_theta" if where.startswith("rope_parameters") else where,
                       theta, "the RoPE base must be a number > 1")
    return float(theta), scaling


def layer_types(f: Fields, num_layers: int, fallback: Callable[[int], bool]) -> list[str]:
    """Per layer ``"full"`` or ``"local"``: the file's ``layer_types``, else ``fallback(i)``
    (True = sliding).

    Raises:
        ConfigFieldError: for a ``layer_types`` that is not a list of ``num_layers`` known
            names.
    """
    given = f.get("layer_types")
    if given is None:
        return ["local" if fallback(i) else "full" for i in range(num_layers)]
    if not isinstance(given, list) or len(given) != num_layers:
        n = len(given) if isinstance(given, list) else type(given).__name__
        raise f.refuse("layer_types", given, f"must list one type per layer: "
                                             f"num_hidden_layers={num_layers}, found {n}")
    bad = sorted({str(t) for t in given if t not in LAYER_TYPES})
    if bad:
        raise f.refuse("layer_types", given, f"unknown layer types {bad}; supported: "
                                             f"{sorted(LAYER_TYPES)}")
    return [LAYER_TYPES[t] for t in given]


def window_size(f: Fields, types: list[str], max_len: int,
                name: str = "sliding_window") -> tuple[list[str], int | None]:
    """The sliding window as handformer's ``window_size = 2 W - 1``, and the layer types.

    A window ``W >= max_len`` reaches every earlier token of any sequence the model takes, so
    those layers become full attention (the same numbers, on the fused kernel). Without any
    sliding layer, or with ``sliding_window`` null, every layer is full.

    Raises:
        ConfigFieldError: for a window that is not a positive integer.
    """
    if "local" not in types:
        return types, None
    W = f.get(name)
    if W is None:
        return ["full"] * len(types), None
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise f.refuse(name, W, "must be a positive integer (keys each query sees, itself "
                                "included) or null")
    if W >= max_len:
        return ["full"] * len(types), None
    return types, 2 * W - 1


# ---- key layouts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where a family's checkpoints keep its tensors, and the names they may use.

    The families' key maps are written in one canonical spelling (``model.`` + the body's
    names, ``lm_head.weight``); a file may spell the body's prefix differently (a base model
    saved without ``model.``, Gemma 3's ``model.language_model.`` or
    ``language_model.model.``). :meth:`prefix_of` finds the file's spelling from one key every
    checkpoint of the family holds.

    Attributes:
        body: the canonical prefix of the body's keys.
        bodies: every prefix a file may use for them, in the order they are tried.
        anchor: a body key (without prefix) every checkpoint has (the token embedding).
        heads: file names of the LM head's weight -> canonical name.
        skip: file key prefixes skipped on purpose (a vision tower).
        skip_suffixes: file key endings skipped on purpose (old constant buffers).
    """

    body: str
    bodies: tuple[str, ...]
    anchor: str
    heads: tuple[str, ...] = ("lm_head.weight",)
    skip: tuple[str, ...] = ()
    skip_suffixes: tuple[str, ...] = ()

    def prefix_of(self, keys: object) -> str:
        """The body prefix the file uses (the canonical one when no anchor is found)."""
        keys = set(keys)  # type: ignore[arg-type]
        for prefix in self.bodies:
            if prefix + self.anchor in keys:
                return prefix
        return self.body

    def head_of(self, keys: object) -> str:
        """The LM head's name in the file (the first spelling when it holds none)."""
        keys = set(keys)  # type: ignore[arg-type]
        return next((h for h in self.heads if h in keys), self.heads[0])

    def skips(self, key: str) -> bool:
        """Whether a file key is skipped on purpose."""
        return bool((self.skip and key.startswith(self.skip))
                    or (self.skip_suffixes and key.endswith(self.skip_suffixes)))

    def to_file(self, keys: object) -> Callable[[str], str]:
        """Canonical key -> the same key in the spelling of a file holding ``keys``."""
        keys = list(keys)  # type: ignore[arg-type]
        prefix, head = self.prefix_of(keys), self.head_of(keys)

        def rename(key: str) -> str:
            if key == self.heads[0]:
                return head
            if key.startswith(self.body):
                return prefix + key[len(self.body):]
            return key

        return rename


# Llama's checkpoints (and Mistral's, Qwen's): the body under ``model.``, or with no prefix in
# a base model saved alone.
LLAMA_LAYOUT = Layout(body="model.", bodies=("model.", ""), anchor="embed_tokens.weight")


@dataclass(frozen=True)
class GGUFRules:
    """A family's GGUF files (llama.cpp): the ``general.architecture`` values it reads and what
    llama.cpp's converter changed in them, which :mod:`handformer.pretrained.gguf.convert`
    undoes. Which tensors a file holds (biases, QK-norm, sandwich norms) is not repeated here:
    the converter asks the family's ``config_from_hf`` for the file's config.

    Attributes:
        architectures: the GGUF ``general.architecture`` values of the family's files.
        permuted_qk: llama.cpp reordered the rows of ``q_proj`` and ``k_proj`` (weights and
            biases) within each head, from rotating halves to rotating interleaved pairs.
        norms_plus_one: llama.cpp stores each RMSNorm weight as ``w + 1`` (for a family whose
            norm multiplies by ``1 + w``).
    """

    architectures: tuple[str, ...]
    permuted_qk: bool = False
    norms_plus_one: bool = False


# ---- the shared decoder: config and key map ----------------------------------------------

LLAMA_NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
SANDWICH_NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln1_post",
                  "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ln2_post"}


def heads(f: Fields) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)``, checked against each other.

    Raises:
        ConfigFieldError: for ``num_key_value_heads`` that does not divide
            ``num_attention_heads``, or no ``head_dim`` where ``hidden_size`` does not split.
    """
    H = f.int("num_attention_heads")
    H_kv = f.get("num_key_value_heads")
    H_kv = H if H_kv is None else H_kv
    if isinstance(H_kv, bool) or not isinstance(H_kv, int) or not 1 <= H_kv <= H or H % H_kv:
        raise f.refuse("num_key_value_heads", H_kv, f"must divide num_attention_heads={H} "
                                                    "(1 <= it <= num_attention_heads)")
    D = f.get("head_dim")
    E = f.int("hidden_size")
    if D is None:
        if E % H:
            raise f.refuse("hidden_size", E, f"is not divisible by num_attention_heads={H} "
                                             "and head_dim is not given")
        D = E // H
    if isinstance(D, bool) or not isinstance(D, int) or D < 2 or D % 2:
        raise f.refuse("head_dim", D, "must be an even integer >= 2 (RoPE rotates pairs)")
    return H, H_kv, D


def decoder_key_map(config: object, norms: Mapping[str, str], *, body: str = "model."
                    ) -> dict[str, str]:
    """The canonical Hugging Face key -> handformer key map of a Llama-style decoder.

    Args:
        config: the :class:`~handformer.CausalLMConfig` (its biases, QK-norm, sandwich norms
            and head tying decide which keys exist).
        norms: the family's per-layer norm names -> handformer's (``ln1``, ``ln2``,
            ``ln1_post``, ``ln2_post``).
        body: the canonical prefix of the body's keys.
    """
    c = config
    keys = {f"{body}embed_tokens.weight": "tok_emb.weight", f"{body}norm.weight": "ln_final.weight"}
    if not c.tie_weights:  # type: ignore[attr-defined]
        keys["lm_head.weight"] = "lm_head.weight"
    biases = {"q_proj": c.qkv_bias, "k_proj": c.qkv_bias,  # type: ignore[attr-defined]
              "v_proj": c.qkv_bias, "o_proj": c.out_bias}  # type: ignore[attr-defined]
    for i in range(c.num_layers):  # type: ignore[attr-defined]
        hf, ours = f"{body}layers.{i}.", f"blocks.{i}."
        for name, bias in biases.items():
            our_name = "out_proj" if name == "o_proj" else name
            keys[f"{hf}self_attn.{name}.weight"] = f"{ours}attn.{our_name}.weight"
            if bias:
                keys[f"{hf}self_attn.{name}.bias"] = f"{ours}attn.{our_name}.bias"
        if c.qk_norm:  # type: ignore[attr-defined]
            for name in ("q_norm", "k_norm"):
                keys[f"{hf}self_attn.{name}.weight"] = f"{ours}attn.{name}.weight"
        for name, ours_norm in norms.items():
            keys[f"{hf}{name}.weight"] = f"{ours}{ours_norm}.weight"
        for name in ("gate_proj", "up_proj", "down_proj"):
            keys[f"{hf}mlp.{name}.weight"] = f"{ours}mlp.{name}.weight"
            if c.mlp_bias:  # type: ignore[attr-defined]
                keys[f"{hf}mlp.{name}.bias"] = f"{ours}mlp.{name}.bias"
    return keys


def decoder_config(f: Fields, *, act: str, qkv_bias: bool, out_bias: bool, mlp_bias: bool,
                   types: list[str], window: int | None, rope: tuple[float, dict | None],
                   local_rope: tuple[float, dict | None] | None = None,
                   qk_norm: bool = False, norm_offset: float = 0.0, sandwich_norm: bool = False,
                   embed_scale: float | None = None, attn_scale: float | None = None,
                   attn_softcap: float | None = None, final_softcap: float | None = None,
                   tie_default: bool = False) -> object:
    """The :class:`~handformer.CausalLMConfig` of a RoPE + RMSNorm + gated-MLP decoder.

    Args:
        f: the config.
        act: handformer's activation name.
        qkv_bias, out_bias, mlp_bias: which projections carry biases.
        types: per-layer ``"full"`` / ``"local"``; ``window`` handformer's ``window_size``
            of the local ones (None when there are none).
        rope: ``(base, scaling)`` of full-attention layers (of every layer without
            ``local_rope``).
        local_rope: ``(base, scaling)`` of sliding layers where it differs (Gemma 3); they
            run unscaled.
        qk_norm, norm_offset, sandwich_norm, embed_scale: the features of the family (see
            :class:`CausalLMConfig`).
        attn_scale, attn_softcap, final_softcap: the same.
        tie_default: ``tie_word_embeddings`` when the file does not say.

    Raises:
        ConfigFieldError: for fields the families check here; ``ValueError`` from
            ``CausalLMConfig`` for anything it refuses.
    """
    from handformer.models.causal_lm_config import CausalLMConfig

    H, H_kv, D = heads(f)
    tie = f.get("tie_word_embeddings", tie_default)
    if not isinstance(tie, bool):
        raise f.refuse("tie_word_embeddings", tie, "must be true or false")
    eps = f.number("rms_norm_eps")
    if eps is None:
        raise f.refuse("rms_norm_eps", None, "must be a positive number")
    rotary_base, rotary_scaling = rope
    local = "local" in types
    local_base = None
    if local_rope is not None:
        if local_rope[1] is not None:
            raise f.refuse("rope_parameters.sliding_attention.rope_type",
                           local_rope[1]["rope_type"], "sliding layers run unscaled RoPE; "
                           "only 'default' is supported there")
        local_base = local_rope[0] if local else None
    return CausalLMConfig(
        vocab_size=f.int("vocab_size"), max_len=f.int("max_position_embeddings"),
        d_model=f.int("hidden_size"), num_heads=H, num_layers=f.int("num_hidden_layers"),
        d_ff=f.int("intermediate_size"), dropout=0.0, activation=act, positional="rotary",
        attention="full", window_size=window, tie_weights=tie, norm_first=True,
        layer_norm_eps=eps, bias=False, rotary_base=rotary_base, num_kv_heads=H_kv,
        head_dim=D, norm="rms", norm_offset=norm_offset, mlp="gated", qkv_bias=qkv_bias,
        out_bias=out_bias, mlp_bias=mlp_bias, qk_norm=qk_norm, sandwich_norm=sandwich_norm,
        embed_scale=embed_scale, attn_scale=attn_scale, attn_softcap=attn_softcap,
        final_softcap=final_softcap, layer_types=list(types) if local else None,
        rotary_local_base=local_base, rotary_scaling=rotary_scaling,
        rotary_freq_dtype="float32",  # the checkpoint's frequencies, to the last bit
    )
