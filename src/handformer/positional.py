"""Positional encodings: sinusoidal (fixed) and learned tables.

Shape letters: ``B`` batch, ``L`` length, ``E`` model dim.

Both add their encoding to ``x: (B, L, E)``; ``offset`` shifts the positions (for decoding
with a cache, where the new tokens start at ``offset``). A sequence that runs past the table
raises ``ValueError`` before any lookup.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from handformer.checks import check_dropout, check_positive_int

__all__ = ["SinusoidalPositionalEncoding", "LearnedPositionalEmbedding"]


def _check_range(x: Tensor, offset: int, max_len: int, d_model: int) -> int:
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must be (B, L, {d_model}), got shape {tuple(x.shape)}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    L = x.shape[1]
    if offset + L > max_len:
        raise ValueError(
            f"sequence length {L} (offset {offset}) exceeds max_len={max_len} of the "
            "positional table"
        )
    return L


class SinusoidalPositionalEncoding(nn.Module):
    """The fixed encoding of "Attention Is All You Need":

    ``PE[pos, 2i] = sin(pos / 10000^(2i/E))``, ``PE[pos, 2i+1] = cos(pos / 10000^(2i/E))``.

    Args:
        d_model: model dim ``E`` (any positive integer; odd dims drop the last cosine).
        max_len: longest supported sequence.
        dropout: dropout applied after adding.

    Raises:
        ValueError: for non-positive sizes or dropout outside [0, 1).
    """

    def __init__(self, d_model: int, *, max_len: int = 5000, dropout: float = 0.0) -> None:
        super().__init__()
        self.d_model = check_positive_int("d_model", d_model)
        self.max_len = check_positive_int("max_len", max_len)
        self.dropout = nn.Dropout(check_dropout("dropout", dropout))
        pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
        inv_freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model)
        )  # (ceil(E/2),)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * inv_freq)
        pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
        self.register_buffer("pe", pe.float(), persistent=False)  # (max_len, E)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """``x + PE[offset : offset + L]`` for ``x: (B, L, E)``."""
        L = _check_range(x, offset, self.max_len, self.d_model)
        return self.dropout(x + self.pe[offset:offset + L].to(x.dtype))


class LearnedPositionalEmbedding(nn.Module):
    """A learned table of ``max_len`` position vectors (BERT, GPT-2).

    Args:
        max_len: number of positions.
        d_model: model dim ``E``.
        dropout: dropout applied after adding.

    Raises:
        ValueError: for non-positive sizes or dropout outside [0, 1).
    """

    def __init__(self, max_len: int, d_model: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.max_len = check_positive_int("max_len", max_len)
        self.d_model = check_positive_int("d_model", d_model)
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        self.dropout = nn.Dropout(check_dropout("dropout", dropout))

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """``x + weight[offset : offset + L]`` for ``x: (B, L, E)``."""
        L = _check_range(x, offset, self.max_len, self.d_model)
        return self.dropout(x + self.weight[offset:offset + L])
