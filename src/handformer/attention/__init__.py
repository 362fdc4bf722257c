"""Attention functions and kinds (full, local, strided, linear) sharing one signature."""

from handformer.attention.functional import scaled_dot_product_attention
from handformer.attention.kinds import AttentionKind, FullAttention

__all__ = ["scaled_dot_product_attention", "AttentionKind", "FullAttention"]
