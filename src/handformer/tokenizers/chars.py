"""A character-level vocabulary: what ``handformer train`` writes as a run's ``vocab.json``.

The smallest tokenizer of the protocol (:class:`~handformer.tokenizers.protocol.Tokenizer`):
token id ``i`` is the character ``chars[i]``, there are no special tokens, and it pads on the
left, as the causal models trained on it need.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from handformer.tokenizers.protocol import TokenizerMethods, check_ids
from handformer.weights import write_atomically

__all__ = ["CharVocab", "VOCAB_NAME", "is_char_vocab"]

VOCAB_NAME = "vocab.json"


class CharVocab(TokenizerMethods):
    """A character-level vocabulary: token id ``i`` is the character ``chars[i]``.

    Saved as ``vocab.json``: ``{"kind": "char", "tokens": ["<c0>", "<c1>", ...]}``; every
    token is one character, so ``decode(encode(s)) == s`` for any text over the vocabulary.
    It speaks the tokenizer protocol (:class:`~handformer.tokenizers.protocol.Tokenizer`):
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
        text = json.dumps({"kind": "char", "tokens": self.chars}, ensure_ascii=False) + "\n"
        return write_atomically(path, lambda tmp: tmp.write_bytes(text.encode()))

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


def is_char_vocab(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a character vocabulary written by :meth:`CharVocab.save` (GPT-2's
    ``vocab.json``, a token -> id mapping, is not: its ``kind`` is no ``"char"``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == "char"
