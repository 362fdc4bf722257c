"""Qwen2 and Qwen3 checkpoints: ``model_type`` ``qwen2`` (Qwen2, Qwen2.5) and ``qwen3``.

Both are Llama's decoder (see :mod:`.llama` for the key map) with two differences each:

* Qwen2 puts biases on the query, key and value projections, and none on the output;
* Qwen3 drops those biases (``attention_bias`` sets all four) and adds QK-norm: an RMSNorm
  over each head's query and key (``self_attn.q_norm`` / ``k_norm``, weights of ``head_dim``)
  before RoPE. Its ``head_dim`` is set on its own (128 by default, whatever the width).

Sliding windows: only with ``use_sliding_window: true``, then on the layers from
``max_window_layers`` on, or as ``layer_types`` says. Released Qwen models have it off (a file
may still declare ``sliding_window: 131072``).
"""

from __future__ import annotations

from handformer.pretrained.families.common import (
    LLAMA_LAYOUT,
    LLAMA_NORMS,
    Fields,
    GGUFRules,
    activation,
    decoder_config,
    decoder_key_map,
    layer_types,
    rope_for,
    window_size,
)

__all__ = ["MODEL_TYPES", "LAYOUT", "GGUF", "DEFAULTS", "config_from_hf", "key_map"]

MODEL_TYPES = ("qwen2", "qwen3")
LAYOUT = LLAMA_LAYOUT
GGUF = GGUFRules(architectures=("qwen2", "qwen3"))  # rotating halves, as Hugging Face: no fix-up

_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "max_position_embeddings": 32768, "use_sliding_window": False,
           "sliding_window": 4096, "max_window_layers": 28}
DEFAULTS = {"qwen2": _COMMON, "qwen3": {**_COMMON, "head_dim": 128, "attention_bias": False}}


def config_from_hf(hf: dict) -> object:
    """The :class:`~handformer.CausalLMConfig` of a Qwen2 or Qwen3 ``config.json``.

    Raises:
        ConfigFieldError: (a ``ValueError``) naming the field and value, for what handformer
            does not implement or what does not fit together.
    """
    model_type = hf.get("model_type")
    f = Fields(hf, DEFAULTS[model_type], model_type)
    n = f.int("num_hidden_layers")
    if f.flag("use_sliding_window"):
        first = f.int("max_window_layers", minimum=0)
        types = layer_types(f, n, lambda i: i >= first)
        types, window = window_size(f, types, f.int("max_position_embeddings"))
    else:  # the window is off whatever sliding_window and layer_types say
        types, window = ["full"] * n, None
    if model_type == "qwen2":
        qkv_bias, out_bias, qk_norm = True, False, False
    else:
        qkv_bias = out_bias = f.flag("attention_bias")
        qk_norm = True
    return decoder_config(
        f, act=activation(f, "hidden_act"), qkv_bias=qkv_bias, out_bias=out_bias,
        mlp_bias=False, types=types, window=window, rope=rope_for(f), qk_norm=qk_norm,
        tie_default=False,
    )


def key_map(config: object) -> dict[str, str]:
    """Canonical Hugging Face key -> handformer key (``model.`` prefix)."""
    return decoder_key_map(config, LLAMA_NORMS)
