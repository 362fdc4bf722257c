"""handformer: a hand-written Transformer in PyTorch.

Readable in an afternoon, exact enough to run real pretrained checkpoints, with efficient
attention variants and attention maps you can look at.
"""

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

__version__ = "0.1.0"

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
