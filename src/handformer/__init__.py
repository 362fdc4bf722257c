"""handformer: a hand-written Transformer in PyTorch.

Readable in an afternoon, exact enough to run real pretrained checkpoints, with efficient
attention variants and attention maps you can look at.

The names below are imported when first used (``handformer.CausalLM`` imports torch and the
model then), so that ``import handformer`` -- and the ``handformer --help`` command line that
starts with it -- stays quick.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it (a module itself where the two names are equal).
_EXPORTS: dict[str, str] = {
    "interop": "handformer.interop",
    "masks": "handformer.masks",
    "scaled_dot_product_attention": "handformer.attention",
    "AttentionKind": "handformer.attention",
    "FullAttention": "handformer.attention",
    "local_attention": "handformer.attention",
    "LocalAttention": "handformer.attention",
    "strided_attention": "handformer.attention",
    "StridedAttention": "handformer.attention",
    "linear_attention": "handformer.attention",
    "linear_attention_step": "handformer.attention",
    "LinearAttention": "handformer.attention",
    "LinearAttentionState": "handformer.attention",
    "MultiHeadAttention": "handformer.layers",
    "FeedForward": "handformer.layers",
    "GatedFeedForward": "handformer.layers",
    "LayerNorm": "handformer.norms",
    "RMSNorm": "handformer.norms",
    "EncoderLayer": "handformer.layers",
    "Encoder": "handformer.models.encoder",
    "EncoderOutput": "handformer.models.encoder",
    "SinusoidalPositionalEncoding": "handformer.positional",
    "LearnedPositionalEmbedding": "handformer.positional",
    "DecoderLayer": "handformer.decoder_layer",
    "CausalLM": "handformer.models.causal_lm",
    "CausalLMConfig": "handformer.models.causal_lm",
    "CausalLMOutput": "handformer.models.causal_lm",
    "Decoder": "handformer.models.decoder",
    "DecoderOutput": "handformer.models.decoder",
    "Transformer": "handformer.models.transformer",
    "TransformerOutput": "handformer.models.transformer",
    "RotaryEmbedding": "handformer.positional_rotary",
    "ALiBi": "handformer.positional_rotary",
    "BertConfig": "handformer.pretrained",
    "BertModel": "handformer.pretrained",
    "load_bert": "handformer.pretrained",
    "embed": "handformer.pretrained",
}

__all__ = [
    "interop",
    "masks",
    "scaled_dot_product_attention",
    "AttentionKind",
    "FullAttention",
    "local_attention",
    "LocalAttention",
    "strided_attention",
    "StridedAttention",
    "linear_attention",
    "linear_attention_step",
    "LinearAttention",
    "LinearAttentionState",
    "MultiHeadAttention",
    "FeedForward",
    "GatedFeedForward",
    "LayerNorm",
    "RMSNorm",
    "EncoderLayer",
    "Encoder",
    "EncoderOutput",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "DecoderLayer",
    "CausalLM",
    "CausalLMConfig",
    "CausalLMOutput",
    "Decoder",
    "DecoderOutput",
    "Transformer",
    "TransformerOutput",
    "RotaryEmbedding",
    "ALiBi",
    "BertConfig",
    "BertModel",
    "load_bert",
    "embed",
]


def __getattr__(name: str) -> object:
    """Import a public name, or a subpackage (``handformer.pretrained``), on first use
    (PEP 562) and keep it."""
    origin = _EXPORTS.get(name)
    if origin is None:
        if name.startswith("_") or importlib.util.find_spec(f"handformer.{name}") is None:
            raise AttributeError(f"module 'handformer' has no attribute {name!r}")
        origin = f"handformer.{name}"
    module = importlib.import_module(origin)
    value = module if origin == f"handformer.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and documentation tools read
    from handformer import interop, masks
    from handformer.attention import (
        AttentionKind,
        FullAttention,
        LinearAttention,
        LinearAttentionState,
        LocalAttention,
        StridedAttention,
        linear_attention,
        linear_attention_step,
        local_attention,
        scaled_dot_product_attention,
        strided_attention,
    )
    from handformer.decoder_layer import DecoderLayer
    from handformer.layers import EncoderLayer, FeedForward, GatedFeedForward, MultiHeadAttention
    from handformer.models.causal_lm import CausalLM, CausalLMConfig, CausalLMOutput
    from handformer.models.decoder import Decoder, DecoderOutput
    from handformer.models.encoder import Encoder, EncoderOutput
    from handformer.models.transformer import Transformer, TransformerOutput
    from handformer.norms import LayerNorm, RMSNorm
    from handformer.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
    from handformer.positional_rotary import ALiBi, RotaryEmbedding
    from handformer.pretrained import BertConfig, BertModel, embed, load_bert
