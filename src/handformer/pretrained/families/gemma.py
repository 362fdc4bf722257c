"""Gemma 2 and Gemma 3 checkpoints: ``model_type`` ``gemma2``, ``gemma3_text`` (Gemma 3 1B,
270M) and ``gemma3`` (the multimodal 4B-27B: its text part; the vision tower is skipped).

Gemma is Llama's decoder with these changes, each a :class:`~handformer.CausalLMConfig` field:

* RMSNorm multiplies by ``1 + w`` (``norm_offset=1.0``): the checkpoint stores ``w``, zero
  for an identity norm;
* sandwich norms: besides the norms before attention and MLP, one on each block's output
  before it joins the residual (``sandwich_norm=True``). The key map differs from Llama's
  here -- Gemma's ``post_attention_layernorm`` is the norm on the attention *output*, and the
  norm before the MLP is ``pre_feedforward_layernorm``;
* GeGLU: ``down(gelu_tanh(gate) * up)`` (``hidden_activation``);
* the token embedding is multiplied by ``sqrt(hidden_size)`` (``embed_scale``), the
  attention scores by ``query_pre_attn_scalar ** -0.5`` (``attn_scale``) instead of
  ``head_dim ** -0.5``;
* sliding-window layers: Gemma 2 alternates (layer 0 sliding), Gemma 3 has five sliding
  layers to one global (``layer_types``, or ``sliding_window_pattern`` in older files);
* Gemma 2 soft-caps attention logits and final logits (``c * tanh(x / c)``);
* Gemma 3 adds QK-norm (an ``1 + w`` RMSNorm over each head's query and key, before RoPE)
  and uses two RoPE bases: 10,000 on sliding layers, 1,000,000 (maybe scaled) on global
  ones.

Key map, per layer ``i`` (``model.`` is ``model.language_model.`` or
``language_model.model.`` in a ``gemma3`` file)::

    model.layers.i.input_layernorm             blocks.i.ln1
    model.layers.i.post_attention_layernorm    blocks.i.ln1_post
    model.layers.i.pre_feedforward_layernorm   blocks.i.ln2
    model.layers.i.post_feedforward_layernorm  blocks.i.ln2_post

the attention and MLP projections and the rest as in :mod:`.llama`; the head is tied.
"""

from __future__ import annotations

from collections.abc import Mapping

from handformer.pretrained.families.common import (
    SANDWICH_NORMS,
    ConfigFieldError,
    Fields,
    GGUFRules,
    Layout,
    activation,
    decoder_config,
    decoder_key_map,
    layer_types,
    rope_for,
    window_size,
)

__all__ = ["MODEL_TYPES", "LAYOUT", "GGUF", "DEFAULTS", "config_from_hf", "key_map", "text_config"]

MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")
LAYOUT = Layout(
    body="model.",
    bodies=("model.", "model.language_model.", "language_model.model.", ""),
    anchor="embed_tokens.weight",
    heads=("lm_head.weight", "language_model.lm_head.weight"),
    skip=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
          "multi_modal_projector."),
)
# llama.cpp's RMSNorm multiplies by the stored weight, so its converter stored Gemma's w + 1.
GGUF = GGUFRules(architectures=("gemma2", "gemma3"), norms_plus_one=True)

_COMMON = {"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
           "tie_word_embeddings": True, "hidden_size": 2304, "intermediate_size": 9216,
           "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
           "attention_bias": False}
DEFAULTS = {
    "gemma2": {**_COMMON, "vocab_size": 256000, "max_position_embeddings": 8192,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_COMMON, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0},
}


def text_config(hf: Mapping) -> dict:
    """The text model's config: ``hf`` itself, or a ``gemma3`` file's ``text_config``.

    Raises:
        ConfigFieldError: for a ``gemma3`` file without a ``text_config`` object.
    """
    if hf.get("model_type") != "gemma3":
        return dict(hf)
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigFieldError(f"gemma3 config field text_config={text!r}: must be a JSON "
                               "object (the language model's config)")
    text = dict(text)
    if text.setdefault("model_type", "gemma3_text") != "gemma3_text":
        raise ConfigFieldError(f"gemma3 config field text_config.model_type="
                               f"{text['model_type']!r}: expected 'gemma3_text'")
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def config_from_hf(hf: dict) -> object:
    """The :class:`~handformer.CausalLMConfig` of a Gemma 2 or Gemma 3 ``config.json``.

    Raises:
        ConfigFieldError: (a ``ValueError``) naming the field and value, for what handformer
            does not implement or what does not fit together.
    """
    hf = text_config(hf)
    model_type = hf["model_type"]
    f = Fields(hf, DEFAULTS[model_type], model_type)
    if f.flag("use_bidirectional_attention"):
        raise f.refuse("use_bidirectional_attention", True, "only causal (decoder) Gemma "
                                                            "models are supported")
    n = f.int("num_hidden_layers")
    E = f.int("hidden_size")
    if model_type == "gemma2":
        types = layer_types(f, n, lambda i: i % 2 == 0)
        rope, local_rope, qk_norm = rope_for(f), None, False
    else:
        # older files: sliding_window_pattern; transformers 5 writes _sliding_window_pattern
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise f.refuse("sliding_window_pattern", pattern, "must be a positive integer")
        types = layer_types(f, n, lambda i: (i + 1) % pattern != 0)
        rope = rope_for(f, "full_attention", default_theta=1_000_000.0)
        local_rope = rope_for(f, "sliding_attention", default_theta=10_000.0,
                              legacy_theta="rope_local_base_freq", legacy_scaled=False)
        qk_norm = True
    types, window = window_size(f, types, f.int("max_position_embeddings"))
    scalar = f.number("query_pre_attn_scalar")
    if scalar is None:
        raise f.refuse("query_pre_attn_scalar", None, "must be a positive number")
    bias = f.flag("attention_bias")
    return decoder_config(
        f, act=activation(f, "hidden_activation", "hidden_act"), qkv_bias=bias,
        out_bias=bias, mlp_bias=False, types=types, window=window, rope=rope,
        local_rope=local_rope, qk_norm=qk_norm, norm_offset=1.0, sandwich_norm=True,
        embed_scale=E ** 0.5, attn_scale=scalar ** -0.5,
        attn_softcap=f.number("attn_logit_softcapping"),
        final_softcap=f.number("final_logit_softcapping"), tie_default=True,
    )


def key_map(config: object) -> dict[str, str]:
    """Canonical Hugging Face key -> handformer key (``model.`` prefix)."""
    return decoder_key_map(config, SANDWICH_NORMS)
