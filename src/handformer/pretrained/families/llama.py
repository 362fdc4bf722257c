"""Llama and Mistral checkpoints: ``model_type`` ``llama`` (Llama 1-3, SmolLM, TinyLlama...)
and ``mistral``.

The decoder every later family starts from: token embedding, then per layer RMSNorm ->
grouped-query self-attention with RoPE -> residual, RMSNorm -> SwiGLU MLP
(``down(silu(gate(x)) * up(x))``) -> residual, a final RMSNorm and the LM head. Llama may put
biases on the attention projections (``attention_bias``, all four) and on the MLP
(``mlp_bias``), scale RoPE (``linear`` or ``llama3``) and tie the head. Mistral is Llama
without biases, with every layer a sliding window of ``sliding_window`` keys (null: full).

Key map (Hugging Face -> handformer), per layer ``i``::

    model.layers.i.input_layernorm           blocks.i.ln1
    model.layers.i.self_attn.{q,k,v}_proj    blocks.i.attn.{q,k,v}_proj
    model.layers.i.self_attn.o_proj          blocks.i.attn.out_proj
    model.layers.i.post_attention_layernorm  blocks.i.ln2   (the norm before the MLP)
    model.layers.i.mlp.{gate,up,down}_proj   blocks.i.mlp.{gate,up,down}_proj

and ``model.embed_tokens`` -> ``tok_emb``, ``model.norm`` -> ``ln_final``, ``lm_head`` ->
``lm_head`` (absent when tied).
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

MODEL_TYPES = ("llama", "mistral")
LAYOUT = LLAMA_LAYOUT
# llama.cpp files say ``llama`` for Mistral too; its converter rotates interleaved pairs where
# Hugging Face's Llama rotates halves, so it reordered the q/k rows of every head.
GGUF = GGUFRules(architectures=("llama",), permuted_qk=True)

# transformers' class defaults, for files that leave fields out
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32}
DEFAULTS = {
    "llama": {**_COMMON, "intermediate_size": 11008, "max_position_embeddings": 2048,
              "attention_bias": False, "mlp_bias": False},
    "mistral": {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
}


def config_from_hf(hf: dict) -> object:
    """The :class:`~handformer.CausalLMConfig` of a Llama or Mistral ``config.json``.

    Raises:
        ConfigFieldError: (a ``ValueError``) naming the field and value, for what handformer
            does not implement or what does not fit together.
    """
    model_type = hf.get("model_type")
    f = Fields(hf, DEFAULTS[model_type], model_type)
    n = f.int("num_hidden_layers")
    max_len = f.int("max_position_embeddings")
    if model_type == "mistral":  # one window for every layer (transformers ignores layer_types)
        types, window = window_size(f, ["local"] * n, max_len)
        bias = False
    else:
        types, window = window_size(f, layer_types(f, n, lambda i: False), max_len)
        bias = f.flag("attention_bias")
    return decoder_config(
        f, act=activation(f, "hidden_act"), qkv_bias=bias, out_bias=bias,
        mlp_bias=f.flag("mlp_bias") if model_type == "llama" else False, types=types,
        window=window, rope=rope_for(f), tie_default=False,
    )


def key_map(config: object) -> dict[str, str]:
    """Canonical Hugging Face key -> handformer key (``model.`` prefix, see the module doc)."""
    return decoder_key_map(config, LLAMA_NORMS)
