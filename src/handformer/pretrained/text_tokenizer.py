"""A plain text tokenizer for generation: ``tokenizer.json`` through the ``tokenizers`` library.

Generation needs only three things from a tokenizer: text to ids, ids to text, and the
end-of-text id. :class:`TextTokenizer` wraps a ``tokenizers.Tokenizer`` (GPT-2's byte-level
BPE, or any other saved as ``tokenizer.json``) to provide them; anything with the same
``encode`` / ``decode`` / ``eos_token_id`` can take its place (the ``generate`` command also
accepts a character vocabulary ``vocab.json`` written by the trainer).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

__all__ = ["TextTokenizer"]

TOKENIZER_NAME = "tokenizer.json"


class TextTokenizer:
    """Encode and decode text with a ``tokenizers.Tokenizer``; no special tokens are added.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        eos_token_id: the end-of-text id, or None.
    """

    def __init__(self, tokenizer: object, *, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id

    @classmethod
    def from_dir(cls, folder: str | os.PathLike, *, eos_token_id: int | None = None
                 ) -> TextTokenizer | None:
        """The folder's ``tokenizer.json`` as a :class:`TextTokenizer`, or None without one.

        Raises:
            ValueError: if ``tokenizer.json`` exists but cannot be read.
        """
        path = Path(folder) / TOKENIZER_NAME
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path}: not a readable tokenizers file ({exc})") from exc
        if eos_token_id is None:
            eos_token_id = tokenizer.token_to_id("<|endoftext|>")
        return cls(tokenizer, eos_token_id=eos_token_id)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``.

        Raises:
            TypeError: if ``text`` is not a string.
            ValueError: if it holds lone surrogates (bytes that were not UTF-8).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        from handformer.pretrained.tokenizer import check_unicode

        check_unicode(text, "text")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """The text of ``ids``."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
