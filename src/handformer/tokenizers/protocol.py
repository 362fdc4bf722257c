"""One tokenizer protocol for every tokenizer handformer has.

A BERT WordPiece tokenizer (:class:`~handformer.pretrained.BertTokenizer`), GPT-2's byte-level
BPE (:class:`~handformer.pretrained.TextTokenizer`), an LLM's tokenizer from a folder or a GGUF
file (:class:`~handformer.pretrained.LMTokenizer`) and the trainer's character vocabulary
(:class:`~handformer.train.CharVocab`) all speak :class:`Tokenizer`; commands, ``inspect`` and
``serve`` use nothing else, so they are interchangeable::

    batch = tok(["a text", "a longer text"])   # {"input_ids", "attention_mask"}: (B, L) int64
    ids = tok.encode("a text")                  # list[int], special tokens as the model wants
    tok.decode(ids)                             # back to text
    tok.tokens("a text")                        # the vocabulary's strings: ["a", "Ġtext"]
    tok.to_str_tokens("a text")                 # each token as text: ["a", " text"]
    tok.to_tokens("a text")                     # (1, L) int64, the ids of encode()

Causal language models pad on the left (``padding_side == "left"``: the last column is every
row's last real token, which batched generation needs); encoders pad on the right.

Shape letters: ``B`` batch, ``L`` length (the longest text in the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["Tokenizer", "TokenizerMethods", "PADDING_SIDES", "as_text_batch", "pad_rows",
           "check_ids"]

PADDING_SIDES = ("left", "right")


@runtime_checkable
class Tokenizer(Protocol):
    """What every handformer tokenizer provides (``isinstance(tok, Tokenizer)`` checks it).

    Attributes:
        padding_side: ``"left"`` (causal language models) or ``"right"`` (encoders).
        bos_token_id, eos_token_id, pad_token_id, unk_token_id: the special ids, or None
            where the vocabulary has no such token.
        chat_template: an instruct model's chat template (Jinja), or None (encoders, base
            models, character vocabularies); ``apply_chat_template`` refuses None.
    """

    padding_side: str
    chat_template: str | None

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def unk_token_id(self) -> int | None: ...

    def __call__(self, texts: str | Sequence[str], *, padding: bool = True
                 ) -> dict[str, Tensor]:
        """Tokenize a batch: ``{"input_ids", "attention_mask"}``, each ``(B, L)`` int64, the
        mask 1 for real tokens and 0 for padding (on ``padding_side``). Encoders may add more
        entries (BERT: ``token_type_ids``). ``padding=False`` refuses texts of different
        lengths instead of padding them."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of one text; ``add_special_tokens`` adds what the model expects (BOS for
        Gemma, ``[CLS]``/``[SEP]`` for BERT, nothing for GPT-2 or SmolLM2)."""
        ...

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """The text of ``ids``."""
        ...

    def tokens(self, text: str) -> list[str]:
        """The vocabulary strings of :meth:`encode`'s ids (``"Ġworld"``, ``"##s"``)."""
        ...

    def to_str_tokens(self, text: str) -> list[str]:
        """Each id of :meth:`encode` decoded on its own (``" world"``), e.g. for labels."""
        ...

    def to_tokens(self, text: str) -> Tensor:
        """``(1, L)`` int64: :meth:`encode`'s ids (special tokens exactly as it adds them)."""
        ...

    def __len__(self) -> int:
        """The vocabulary size."""
        ...


class TokenizerMethods:
    """The protocol's batch and convenience methods, written once on top of a class's own
    ``encode`` / ``decode`` / ``id_to_token`` and special ids.

    A subclass defines ``encode(text, add_special_tokens=True)``, ``decode(ids)``,
    ``id_to_token(i)``, ``pad_token_id`` / ``eos_token_id`` and ``padding_side``.
    """

    padding_side: str = "left"
    chat_template: str | None = None  # only instruct models' tokenizers have one

    def apply_chat_template(self, messages: Sequence[object], *,
                            add_generation_prompt: bool = True) -> str:
        """A conversation as prompt text; this tokenizer has no chat template.

        Raises:
            ValueError: always (tokenizers with a template override this).
        """
        raise ValueError(f"{type(self).__name__} has no chat template (not an instruct "
                         "model's tokenizer); pass the prompt as plain text instead")

    def __call__(self, texts: str | Sequence[str], *, padding: bool = True
                 ) -> dict[str, Tensor]:
        """Tokenize and pad a batch (see :meth:`Tokenizer.__call__`).

        Returns:
            ``{"input_ids", "attention_mask"}``, each ``(B, L)`` int64.

        Raises:
            TypeError: for texts that are not strings.
            ValueError: for an empty batch, a text that gives no tokens, or texts of different
                lengths with ``padding=False``.
        """
        batch = as_text_batch(texts)
        rows = [self.encode(t) for t in batch]
        empty = [i for i, r in enumerate(rows) if not r]
        if empty:
            raise ValueError(f"text {empty[0]} ({batch[empty[0]]!r:.40}) gives no tokens; "
                             "give every text at least one token")
        return pad_rows(rows, pad_id=self._padding_id(), side=self.padding_side,
                        padding=padding)

    def tokens(self, text: str) -> list[str]:
        """The vocabulary strings of :meth:`encode`'s ids."""
        return [self.id_to_token(i) for i in self.encode(text)]

    def to_str_tokens(self, text: str) -> list[str]:
        """Each id of :meth:`encode` decoded on its own."""
        return [self.decode([i]) for i in self.encode(text)]

    def to_tokens(self, text: str) -> Tensor:
        """``(1, L)`` int64 ids of :meth:`encode` (special tokens exactly as it adds them)."""
        return torch.tensor([self.encode(text)], dtype=torch.long)  # (1, L)

    def _padding_id(self) -> int:
        """The id written in padding: the pad token, else EOS, else 0 (masked out anyway)."""
        for value in (self.pad_token_id, self.eos_token_id):
            if value is not None:
                return int(value)
        return 0

    # Declared for type checkers; subclasses provide them.
    pad_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        raise NotImplementedError

    def id_to_token(self, i: int) -> str:
        raise NotImplementedError


def as_text_batch(texts: object) -> list[str]:
    """One text or a list of texts -> a non-empty list of strings.

    Raises:
        TypeError: naming the first item that is not a string.
        ValueError: for an empty list.
    """
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a string or a list of strings, got "
                        f"{type(texts).__name__}")
    if len(texts) == 0:
        raise ValueError("texts is an empty list; give at least one text")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"text {i} must be a string, got {type(t).__name__}: {t!r:.60}")
    return list(texts)


def pad_rows(rows: Sequence[Sequence[int]], *, pad_id: int, side: str, padding: bool = True
             ) -> dict[str, Tensor]:
    """Rows of ids -> ``{"input_ids", "attention_mask"}`` ``(B, L)`` int64, padded on ``side``.

    Raises:
        ValueError: for rows of different lengths with ``padding=False``, or an unknown side.
    """
    if side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {side!r}")
    lengths = [len(r) for r in rows]
    L = max(lengths)
    if not padding and min(lengths) != L:
        raise ValueError(f"padding=False but the texts have different lengths {lengths} "
                         "(in tokens); pass padding=True")
    ids, mask = [], []
    for r in rows:
        fill = L - len(r)
        if side == "left":
            ids.append([pad_id] * fill + list(r))
            mask.append([0] * fill + [1] * len(r))
        else:
            ids.append(list(r) + [pad_id] * fill)
            mask.append([1] * len(r) + [0] * fill)
    return {"input_ids": torch.tensor(ids, dtype=torch.long),  # (B, L)
            "attention_mask": torch.tensor(mask, dtype=torch.long)}  # (B, L)


def check_ids(ids: object, size: int) -> list[int]:
    """Token ids as a list of ints, each in ``[0, size)``.

    Raises:
        TypeError: for something that is not a sequence of integers.
        ValueError: naming the first id outside the vocabulary.
    """
    if isinstance(ids, Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ids must be integers, got a {ids.dtype} tensor")
        ids = ids.reshape(-1).tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"ids must be a list of token ids, got {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            try:
                i = int(i.__index__())  # numpy integers
            except AttributeError:
                raise TypeError(f"ids must be integers, got {type(i).__name__}: {i!r:.40}"
                                ) from None
        if not 0 <= i < size:
            raise ValueError(f"id {i} is outside the vocabulary (0 ... {size - 1})")
        out.append(i)
    return out
