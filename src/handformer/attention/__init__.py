"""Attention functions and kinds (full, local, sinks, strided, linear) sharing one signature."""

from handformer.attention.functional import attention_reference, scaled_dot_product_attention
from handformer.attention.kinds import AttentionKind, FullAttention
from handformer.attention.linear import (
    LinearAttention,
    LinearAttentionState,
    linear_attention,
    linear_attention_step,
)
from handformer.attention.local import LocalAttention, local_attention
from handformer.attention.registry import attention_kind
from handformer.attention.sinks import SinkAttention, SinkWindowKVCache, sink_attention
from handformer.attention.sparse import StridedAttention, strided_attention

__all__ = [
    "attention_reference",
    "scaled_dot_product_attention",
    "AttentionKind",
    "FullAttention",
    "local_attention",
    "LocalAttention",
    "sink_attention",
    "SinkAttention",
    "SinkWindowKVCache",
    "strided_attention",
    "StridedAttention",
    "linear_attention",
    "linear_attention_step",
    "LinearAttention",
    "LinearAttentionState",
    "attention_kind",
]
