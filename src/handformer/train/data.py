"""Data for training: a character vocabulary, text loading, and step-seeded batches.

Every batch is a pure function of ``(seed, step, micro_step)``: the generator that draws it is
seeded from those three numbers (:func:`batch_generator`). So the "data position" of a run is
just its step, resuming needs no sampler state, and every rank of a distributed run draws the
same *global* batch and keeps its own slice of rows (:func:`shard_rows`) — the deterministic
equivalent of a ``DistributedSampler``. One process with global batch ``B`` and ``N``
processes with ``B / N`` rows each see exactly the same examples.

Shape letters: ``B`` batch, ``L`` length.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from handformer.pretrained.protocol import TokenizerMethods, check_ids

__all__ = ["CharVocab", "read_text", "batch_generator", "shard_rows", "VOCAB_NAME"]

VOCAB_NAME = "vocab.json"


class CharVocab(TokenizerMethods):
    """A character-level vocabulary: token id ``i`` is the character ``chars[i]``.

    Saved as ``vocab.json``: ``{"kind": "char", "tokens": ["<c0>", "<c1>", ...]}``; every
    token is one character, so ``decode(encode(s)) == s`` for any text over the vocabulary.
    It speaks the tokenizer protocol (:class:`~handformer.pretrained.protocol.Tokenizer`):
    it has no special tokens (``bos/eos/pad/unk_token_id`` are None; padding writes id 0,
    masked out) and pads on the left, as the causal models trained on it need.

    Args:
        tokens: distinct single characters, in id order (kept as :attr:`chars`).

    Raises:
        ValueError: for an empty list, duplicates or tokens that are not one character.
    """

    def __init__(self, tokens: Sequence[str]) -> None:
        tokens = list(tokens)
        if not tokens:
            raise ValueError("a vocabulary needs at least one token")
        bad = [t for t in tokens if not isinstance(t, str) or len(t) != 1]
        if bad:
            raise ValueError(f"character vocabulary tokens must be single characters, got "
                             f"{bad[:5]!r}")
        if len(set(tokens)) != len(tokens):
            raise ValueError("character vocabulary tokens must be distinct")
        self.chars = tokens
        self.index = {t: i for i, t in enumerate(tokens)}

    padding_side = "left"
    bos_token_id = eos_token_id = pad_token_id = unk_token_id = None

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (there are no special tokens to add).

        Raises:
            TypeError: if ``text`` is not a string.
            ValueError: naming the first character that is not in the vocabulary.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}: {text!r:.60}")
        try:
            return [self.index[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary "
                             f"({len(self)} characters)") from None

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """The text of ``ids``.

        Raises:
            ValueError: for an id outside the vocabulary.
        """
        return "".join(self.chars[i] for i in check_ids(ids, len(self.chars)))

    def id_to_token(self, i: int) -> str:
        """The character of id ``i``."""
        return self.chars[i]

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``vocab.json`` atomically (temp file, fsync, rename)."""
        from handformer.train.checkpoint import atomic_write_bytes

        text = json.dumps({"kind": "char", "tokens": self.chars}, ensure_ascii=False)
        return atomic_write_bytes(Path(path), (text + "\n").encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CharVocab:
        """Read a ``vocab.json`` written by :meth:`save`.

        Raises:
            FileNotFoundError: if it does not exist.
            ValueError: if it is not a character vocabulary.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no vocabulary file {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(data, dict) or data.get("kind") != "char":
            raise ValueError(f"{path}: not a character vocabulary (kind must be 'char')")
        return cls(data.get("tokens") or [])


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
