"""The attention-values budget ``handformer viz`` and ``handformer serve`` share.

Showing a model's attention means holding every head's ``L x L`` weights at once:
``layers x heads x L²`` float32 values, which grows fast with the text (1600 tokens on
SmolLM2-135M, 30 layers x 9 heads, are 691 M values: 2.8 GB, and minutes of work). Both
commands stay within :data:`VIEW_BUDGET` values: ``serve`` cuts a request's text to
:func:`view_limit` tokens, ``viz`` refuses a longer text up front and names ``--max-tokens``.
"""

from __future__ import annotations

import math

__all__ = ["VIEW_BUDGET", "MIN_TOKENS", "attention_values", "view_limit", "describe_cost",
           "describe_values"]

# Attention weights one run may hold (layers x heads x tokens^2): about 320 MB of float32.
# SmolLM2-135M (30 x 9 heads) fits 544 tokens; Gemma 3 270M (18 x 4) 1054; MiniLM its 512.
VIEW_BUDGET = 80_000_000
# Tokens always allowed, whatever the model's size (a model of 80 M / 16² = 312 500 heads
# would otherwise get none).
MIN_TOKENS = 16


def attention_values(num_layers: int, num_heads: int, tokens: int) -> int:
    """How many attention weights a run on ``tokens`` tokens holds: layers x heads x L²."""
    return num_layers * num_heads * tokens * tokens


def view_limit(num_layers: int, num_heads: int) -> int:
    """The most tokens whose attention weights fit :data:`VIEW_BUDGET` (at least
    :data:`MIN_TOKENS`).

    Args:
        num_layers: the model's layers.
        num_heads: attention heads per layer.

    Returns:
        The token limit.
    """
    return max(MIN_TOKENS, math.isqrt(VIEW_BUDGET // max(1, num_layers * num_heads)))


def describe_values(values: int) -> str:
    """``values`` and their float32 bytes in words, e.g. ``691 M values (2.8 GB)``."""
    size = 4 * values
    if values < 1_000_000:
        return f"{values} values ({size / 1e3:.0f} kB)"
    count = f"{values / 1e6:.0f} M" if values >= 10_000_000 else f"{values / 1e6:.1f} M"
    return f"{count} values ({size / 1e9:.1f} GB)" if size >= 1e9 else \
        f"{count} values ({size / 1e6:.0f} MB)"


def describe_cost(num_layers: int, num_heads: int, tokens: int) -> str:
    """The estimate in words, e.g. ``30 layers x 9 heads x 1600² = 691 M values (2.8 GB)``."""
    return (f"{num_layers} layer{'s' * (num_layers != 1)} x {num_heads} "
            f"head{'s' * (num_heads != 1)} x {tokens}\u00b2 = "
            f"{describe_values(attention_values(num_layers, num_heads, tokens))}")
