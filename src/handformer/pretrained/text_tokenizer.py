"""A plain text tokenizer for generation: ``tokenizer.json`` through the ``tokenizers`` library.

Generation needs only three things from a tokenizer: text to ids, ids to text, and the
end-of-text id. :class:`TextTokenizer` wraps a ``tokenizers.Tokenizer`` (any saved as
``tokenizer.json``, or GPT-2's byte-level BPE rebuilt from ``vocab.json`` + ``merges.txt``,
the files of transformers' ``GPT2Tokenizer``) to provide them; anything with the same
``encode`` / ``decode`` / ``eos_token_id`` can take its place (the ``generate`` command also
accepts a character vocabulary ``vocab.json`` written by the trainer).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

__all__ = ["TextTokenizer", "byte_level_bpe", "missing_tokenizer_note"]

TOKENIZER_NAME = "tokenizer.json"
BPE_FILES = ("vocab.json", "merges.txt")
EOS_TOKEN = "<|endoftext|>"


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
        """The folder's tokenizer as a :class:`TextTokenizer`, or None without one.

        ``tokenizer.json`` is preferred; else ``vocab.json`` + ``merges.txt`` make GPT-2's
        byte-level BPE (:func:`byte_level_bpe`). :func:`missing_tokenizer_note` says what is
        missing when this returns None.

        Raises:
            ValueError: if the tokenizer files exist but cannot be read.
        """
        folder = Path(folder)
        path = folder / TOKENIZER_NAME
        vocab, merges = (folder / name for name in BPE_FILES)
        if path.is_file():
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises a bare Exception on bad files
                raise ValueError(f"{path}: not a readable tokenizers file ({exc})") from exc
        elif vocab.is_file() and merges.is_file():
            tokenizer = byte_level_bpe(vocab, merges)
        else:
            return None
        if eos_token_id is None:
            eos_token_id = tokenizer.token_to_id(EOS_TOKEN)
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


def byte_level_bpe(vocab_file: Path, merges_file: Path) -> object:
    """GPT-2's byte-level BPE tokenizer from ``vocab.json`` + ``merges.txt``.

    The pipeline of transformers' ``GPT2Tokenizer``: text is split by GPT-2's pattern
    (words with their leading space, numbers, punctuation runs, whitespace), each piece's
    UTF-8 bytes are mapped to printable characters, BPE merges them in ``merges.txt``'s order;
    decoding maps the characters back to bytes. ``<|endoftext|>`` and the special tokens named
    in the folder's ``special_tokens_map.json`` are kept whole (never split by BPE).

    Returns:
        A ``tokenizers.Tokenizer``.

    Raises:
        ValueError: if the files cannot be read as a BPE vocabulary and merge list.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    try:
        bpe = models.BPE.from_file(str(vocab_file), str(merges_file))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"{vocab_file.parent}: vocab.json + merges.txt are not a readable BPE "
                         f"vocabulary and merge list ({exc})") from exc
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [EOS_TOKEN, *_special_token_names(vocab_file.parent / "special_tokens_map.json")]
    vocab = tokenizer.get_vocab()
    known = [t for t in dict.fromkeys(specials) if t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in known])
    return tokenizer


def _special_token_names(path: Path) -> list[str]:
    """The token strings of a ``special_tokens_map.json`` (values: strings or
    ``{"content": ...}``; ``additional_special_tokens``: a list of them)."""
    import json

    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return []
    names: list[str] = []
    values = list(data.values()) if isinstance(data, dict) else []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                item = item.get("content")
            if isinstance(item, str):
                names.append(item)
    return names


def missing_tokenizer_note(folder: str | os.PathLike) -> str:
    """Which tokenizer files a folder lacks, for :meth:`TextTokenizer.from_dir` returning None."""
    folder = Path(folder)
    present = [name for name in BPE_FILES if (folder / name).is_file()]
    if present:
        absent = [name for name in BPE_FILES if name not in present]
        return (f"{folder} has no tokenizer: {present[0]} is there but {absent[0]} is missing "
                f"(GPT-2's byte-level BPE needs both), and there is no {TOKENIZER_NAME}")
    return (f"{folder} has no tokenizer: expected {TOKENIZER_NAME}, or vocab.json + "
            "merges.txt (GPT-2's byte-level BPE), and none of them is there")
