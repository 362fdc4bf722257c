"""Data for training: text loading and step-seeded batches (the character vocabulary,
:class:`~handformer.tokenizers.chars.CharVocab`, is re-exported here).

Every batch is a pure function of ``(seed, step, micro_step)``: the generator that draws it is
seeded from those three numbers (:func:`batch_generator`). So the "data position" of a run is
just its step, resuming needs no sampler state, and every rank of a distributed run draws the
same *global* batch and keeps its own slice of rows (:func:`shard_rows`) — the deterministic
equivalent of a ``DistributedSampler``. One process with global batch ``B`` and ``N``
processes with ``B / N`` rows each see exactly the same examples.

Shape letters: ``B`` batch, ``L`` length.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from handformer.tokenizers.chars import VOCAB_NAME, CharVocab

__all__ = ["CharVocab", "read_text", "batch_generator", "shard_rows", "VOCAB_NAME"]


def read_text(path: str | os.PathLike[str]) -> str:
    """Read a UTF-8 text file for a character-level language model.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is not a file, is empty or is not UTF-8.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"text file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"text file {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"text file {path} is not UTF-8 ({exc.reason} at byte "
                         f"{exc.start})") from None
    if not text:
        raise ValueError(f"text file {path} is empty")
    return text


def batch_generator(seed: int, step: int, micro_step: int = 0) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, micro_step)`` alone.

    The three numbers are mixed with odd 64-bit constants, so neighbouring steps or seeds get
    unrelated streams.
    """
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9
             + micro_step * 0x94D049BB133111EB + 1) % (1 << 64)
    g = torch.Generator()
    g.manual_seed(mixed)
    return g


def shard_rows(x: Tensor, rank: int, world_size: int) -> Tensor:
    """Rows ``[rank * B / N, (rank + 1) * B / N)`` of a global batch ``(B, ...)``.

    Raises:
        ValueError: if ``B`` is not divisible by ``world_size``.
    """
    B = x.shape[0]
    if B % world_size:
        raise ValueError(f"a batch of {B} rows cannot be split evenly over {world_size} ranks")
    n = B // world_size
    return x[rank * n:(rank + 1) * n]
