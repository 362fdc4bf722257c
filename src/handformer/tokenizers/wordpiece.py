"""A WordPiece tokenizer for BERT-family checkpoints, on the ``tokenizers`` library.

It turns text (or pairs of texts) into the padded tensors a :class:`BertModel` takes::

    enc = tokenizer(["a sentence", "another, longer sentence"])
    enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]   # each (B, L)

It speaks the one tokenizer protocol (:class:`~handformer.tokenizers.protocol.Tokenizer`:
``encode(text)`` -> ids with ``[CLS]``/``[SEP]``, ``decode``, ``tokens``, ``to_tokens``, ...),
pads on the right, and adds BERT's own batch API: pairs of texts, ``max_length`` /
``truncation``, and :meth:`BertTokenizer.encode_batch` -> ``tokenizers.Encoding`` objects
(offsets, special-token masks) with :meth:`BertTokenizer.pad`.

Shape letters: ``B`` batch, ``L`` length (the longest text in the batch).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Encoding,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
)
from tokenizers.processors import TemplateProcessing
from torch import Tensor

from handformer.tokenizers.protocol import TokenizerMethods, check_ids

__all__ = ["BertTokenizer"]

TextInput = str | Sequence[str] | Sequence[tuple[str, str]]


class BertTokenizer(TokenizerMethods):
    """Text -> padded ``input_ids`` / ``attention_mask`` / ``token_type_ids`` tensors.

    Everything it returns fits the model: texts longer than ``max_length`` tokens are cut
    (with a warning) by :meth:`__call__`, :meth:`encode`, :meth:`tokens` and :meth:`to_tokens`
    alike, keeping the closing ``[SEP]``.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` that adds ``[CLS]``/``[SEP]`` (its own padding
            and truncation settings are switched off; this class does both).
        max_length: the longest encoding allowed (the model's position table).
        pad_id: id of the padding token (default: the id of ``[PAD]``, else 0).

    Raises:
        ValueError: for ``max_length < 2``.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_length: int = 512,
                 pad_id: int | None = None) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
        self._tokenizer = tokenizer
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self._json = tokenizer.to_str()
        self._truncating: dict[int, Tokenizer] = {}
        self.max_length = max_length
        if pad_id is None:
            pad_id = tokenizer.token_to_id("[PAD]") or 0
        self.pad_id = pad_id

    padding_side = "right"
    bos_token_id = eos_token_id = None  # BERT has [CLS] / [SEP] instead (see below)

    @property
    def pad_token_id(self) -> int:
        """The padding id (:attr:`pad_id`)."""
        return self.pad_id

    @property
    def unk_token_id(self) -> int | None:
        """The id of ``[UNK]``, or None."""
        return self._tokenizer.token_to_id("[UNK]")

    @property
    def cls_token_id(self) -> int | None:
        """The id of ``[CLS]``, or None."""
        return self._tokenizer.token_to_id("[CLS]")

    @property
    def sep_token_id(self) -> int | None:
        """The id of ``[SEP]``, or None."""
        return self._tokenizer.token_to_id("[SEP]")

    @property
    def mask_token_id(self) -> int | None:
        """The id of ``[MASK]``, or None."""
        return self._tokenizer.token_to_id("[MASK]")

    @classmethod
    def from_dir(cls, path: str | os.PathLike, *, max_length: int | None = None
                 ) -> BertTokenizer:
        """Load ``tokenizer.json`` (preferred) or ``vocab.txt`` from a checkpoint folder.

        ``max_length`` defaults to the smallest of ``config.json``'s
        ``max_position_embeddings`` and ``tokenizer_config.json``'s ``model_max_length``
        (512 when neither is there). ``vocab.txt`` is lower-cased unless
        ``tokenizer_config.json`` says ``"do_lower_case": false`` (its ``strip_accents``,
        ``tokenize_chinese_chars`` and special-token names are followed too), and its special
        tokens (``[CLS]``, ``[SEP]``, ``[PAD]``, ``[UNK]``, ``[MASK]``) are kept whole in the
        text, as ``tokenizer.json`` and transformers' ``BertTokenizer`` do.

        Raises:
            FileNotFoundError: if the folder has neither file.
        """
        path = Path(path)
        config = _read_json(path / "config.json")
        tok_config = _read_json(path / "tokenizer_config.json")
        if max_length is None:
            limits = [v for v in (config.get("max_position_embeddings"),
                                  tok_config.get("model_max_length"))
                      if isinstance(v, int) and 2 <= v <= 1_000_000]
            max_length = min(limits) if limits else 512
        if (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        elif (path / "vocab.txt").is_file():
            tokenizer = wordpiece_from_vocab(
                path / "vocab.txt", lowercase=bool(tok_config.get("do_lower_case", True)),
                strip_accents=tok_config.get("strip_accents"),
                chinese_chars=bool(tok_config.get("tokenize_chinese_chars", True)),
                special_tokens=_special_tokens(tok_config))
        else:
            raise FileNotFoundError(f"{path} has no tokenizer: expected tokenizer.json or "
                                    "vocab.txt")
        return cls(tokenizer, max_length=max_length)

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary."""
        return self._tokenizer.get_vocab_size()

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. ``"[MASK]"``), or None if it has none."""
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        """The vocabulary string of id ``i``."""
        return self._tokenizer.id_to_token(check_ids([i], self.vocab_size)[0])

    def tokens(self, text: str, text_pair: str | None = None) -> list[str]:
        """The token strings of one text (with ``[CLS]``/``[SEP]``), e.g. heat-map labels.

        Truncated like :meth:`__call__` with ``truncation=True``.
        """
        return self.encode_batch([text] if text_pair is None
                                 else [(text, text_pair)])[0].tokens

    def encode(self, text: str, add_special_tokens: bool = True, *,  # type: ignore[override]
               truncation: bool = True, **batch_options: object) -> list[int]:
        """The ids of one text, ``[CLS] ... [SEP]`` with ``add_special_tokens``; cut to the
        model's limit (with a warning) unless ``truncation=False`` (then: every token).

        A list of texts is the batch form of earlier versions (deprecated): it returns
        :meth:`encode_batch`'s ``tokenizers.Encoding`` objects.

        Raises:
            TypeError: if ``text`` is not a string.
            ValueError: for an empty text or lone surrogates.
        """
        if not isinstance(text, str) and isinstance(text, (list, tuple)):
            warnings.warn("BertTokenizer.encode(list of texts) is deprecated: it is "
                          "encode_batch(texts); encode(text) returns one text's ids",
                          DeprecationWarning, stacklevel=2)
            pairs = None if isinstance(add_special_tokens, bool) else add_special_tokens
            return self.encode_batch(text, pairs, truncation=truncation, **batch_options)
        if batch_options:
            raise TypeError(f"encode(text) takes no {sorted(batch_options)}; those options "
                            "belong to __call__ and encode_batch")
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}: {text!r:.60}")
        _check_text(text, "text")
        if not truncation:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if len(encoding.ids) > self.max_length:
            warnings.warn(f"1 text(s) longer than {self.max_length} tokens (the longest "
                          f"{len(encoding.ids)}) were truncated to {self.max_length}",
                          stacklevel=2)
            encoding = self._truncating_tokenizer(self.max_length).encode(
                text, add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: Sequence[int] | Tensor, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (WordPiece's ``##`` pieces joined; special tokens dropped with
        ``skip_special_tokens``).

        Raises:
            ValueError: for an id outside the vocabulary.
        """
        return self._tokenizer.decode(check_ids(ids, self.vocab_size),
                                      skip_special_tokens=skip_special_tokens)

    def __call__(self, texts: TextInput,  # type: ignore[override]
                 text_pairs: Sequence[str] | str | None = None, *, padding: bool = True,
                 max_length: int | None = None, truncation: bool = True) -> dict[str, Tensor]:
        """Tokenize and pad a batch (on the right).

        Args:
            texts: one text, a list of texts, or a list of ``(text, text_pair)`` tuples.
            text_pairs: second segments (token type 1), one per text; alternative to tuples.
            padding: pad to the longest text; False refuses texts of different lengths.
            max_length: longest encoding, at most the model's limit (default the limit).
            truncation: cut longer encodings (with a warning); when False they raise.

        Returns:
            ``{"input_ids", "attention_mask", "token_type_ids"}``, each ``(B, L)`` int64;
            ``attention_mask`` is 1 for real tokens and 0 for padding.

        Raises:
            TypeError: for inputs that are not strings.
            ValueError: for an empty batch or empty text, ``max_length`` above the limit, a
                text longer than the limit when ``truncation=False``, or texts of different
                lengths with ``padding=False``.
        """
        encodings = self.encode_batch(texts, text_pairs, max_length=max_length,
                                      truncation=truncation)
        lengths = [len(e.ids) for e in encodings]
        if not padding and len(set(lengths)) > 1:
            raise ValueError(f"padding=False but the texts have different lengths {lengths} "
                             "(in tokens); pass padding=True")
        return self.pad(encodings)

    def encode_batch(self, texts: TextInput, text_pairs: Sequence[str] | str | None = None,
                     *, max_length: int | None = None, truncation: bool = True
                     ) -> list[Encoding]:
        """Like :meth:`__call__` but returns unpadded ``tokenizers.Encoding`` objects (ids,
        tokens, offsets, ``special_tokens_mask``, ``type_ids``), for :meth:`pad`."""
        limit = self._limit(max_length)
        batch = _as_batch(texts, text_pairs)
        encodings = self._tokenizer.encode_batch(batch)
        long = [i for i, e in enumerate(encodings) if len(e.ids) > limit]
        if long:
            worst = max(len(encodings[i].ids) for i in long)
            if not truncation:
                raise ValueError(
                    f"text {long[0]} has {len(encodings[long[0]].ids)} tokens, more than the "
                    f"limit of {limit}; shorten it or pass truncation=True"
                    + (f" ({len(long)} texts are too long, the longest {worst} tokens)"
                       if len(long) > 1 else ""))
            warnings.warn(f"{len(long)} text(s) longer than {limit} tokens (the longest "
                          f"{worst}) were truncated to {limit}", stacklevel=3)
            cut = self._truncating_tokenizer(limit).encode_batch([batch[i] for i in long])
            for i, e in zip(long, cut, strict=True):
                encodings[i] = e
        return encodings

    def pad(self, encodings: Sequence[Encoding]) -> dict[str, Tensor]:
        """Pad encodings to the longest one: ``(B, L)`` int64 tensors."""
        if not encodings:
            raise ValueError("nothing to pad: encodings is empty")
        L = max(len(e.ids) for e in encodings)
        input_ids = torch.tensor([e.ids + [self.pad_id] * (L - len(e.ids))
                                  for e in encodings], dtype=torch.long)  # (B, L)
        attention_mask = torch.tensor([[1] * len(e.ids) + [0] * (L - len(e.ids))
                                       for e in encodings], dtype=torch.long)  # (B, L)
        token_type_ids = torch.tensor([e.type_ids + [0] * (L - len(e.ids))
                                       for e in encodings], dtype=torch.long)  # (B, L)
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "token_type_ids": token_type_ids}

    def _limit(self, max_length: int | None) -> int:
        if max_length is None:
            return self.max_length
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
        if max_length > self.max_length:
            raise ValueError(f"max_length={max_length} is above the model's limit of "
                             f"{self.max_length} tokens")
        return max_length

    def _truncating_tokenizer(self, limit: int) -> Tokenizer:
        if limit not in self._truncating:
            tokenizer = Tokenizer.from_str(self._json)
            tokenizer.enable_truncation(limit)
            self._truncating[limit] = tokenizer
        return self._truncating[limit]

    def __repr__(self) -> str:
        return f"BertTokenizer(vocab_size={self.vocab_size}, max_length={self.max_length})"


SPECIAL_TOKENS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                  "unk_token": "[UNK]", "mask_token": "[MASK]"}


def wordpiece_from_vocab(vocab_file: Path, *, lowercase: bool = True,
                         strip_accents: bool | None = None, chinese_chars: bool = True,
                         special_tokens: dict[str, str] | None = None) -> Tokenizer:
    """BERT's WordPiece pipeline from a ``vocab.txt``: BERT normalisation (clean-up, Chinese
    characters split, optional lower-casing and accent stripping), split on whitespace and
    punctuation, greedy longest-match WordPiece with ``##`` continuations, then
    ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` with token types 0 / 1.

    The special tokens are matched in the raw text before all of that and kept whole (so
    ``"[CLS] [MASK]"`` is two tokens, not ``[``, ``cl``, ``##s``, ...), exactly as in a BERT
    ``tokenizer.json`` and in transformers' ``BertTokenizer``.

    Args:
        vocab_file: the vocabulary, one token per line (the line number is the id).
        lowercase: lower-case the text (``do_lower_case``).
        strip_accents: strip accents; None = when lower-casing (BERT's default).
        chinese_chars: put spaces around CJK characters (``tokenize_chinese_chars``).
        special_tokens: ``{"cls_token": "[CLS]", ...}`` (the names of
            ``tokenizer_config.json``); default BERT's five.

    Raises:
        ValueError: if the vocabulary lacks the ``[CLS]``, ``[SEP]`` or ``[UNK]`` token.
    """
    names = {**SPECIAL_TOKENS, **(special_tokens or {})}
    vocab = models.WordPiece.read_file(str(vocab_file))
    missing = [names[k] for k in ("cls_token", "sep_token", "unk_token") if names[k] not in vocab]
    if missing:
        raise ValueError(f"{vocab_file} lacks the special tokens {missing}")
    cls, sep = names["cls_token"], names["sep_token"]
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=names["unk_token"]))
    tokenizer.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, strip_accents=strip_accents, handle_chinese_chars=chinese_chars)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in dict.fromkeys(names.values()) if t in vocab])
    return tokenizer


def _special_tokens(tok_config: dict) -> dict[str, str]:
    """The special-token names of a ``tokenizer_config.json`` (strings or ``{"content"}``)."""
    found = {}
    for key in SPECIAL_TOKENS:
        value = tok_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[key] = value
    return found


def _check_text(text: object, where: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{where} must be a string, got {type(text).__name__}: {text!r:.60}")
    if not text.strip():
        raise ValueError(f"{where} is empty; give it some text to tokenize")
    check_unicode(text, where)
    return text


def check_unicode(text: str, where: str) -> None:
    """Refuse lone surrogates (Python's stand-in for bytes that are not UTF-8).

    Raises:
        ValueError: naming the first such character and its index.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where} is not valid Unicode: character {exc.object[exc.start]!r} at index "
            f"{exc.start} is a lone surrogate (what Python makes of bytes that are not UTF-8, "
            f"e.g. on the command line); pass UTF-8 text"
        ) from None


def _as_batch(texts: TextInput, text_pairs: Sequence[str] | str | None
              ) -> list[str | tuple[str, str]]:
    """Normalize the accepted input forms to a list of texts or ``(text, pair)`` tuples."""
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(text_pairs, str):
        text_pairs = [text_pairs]
    if not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a string or a list of strings, got "
                        f"{type(texts).__name__}")
    if len(texts) == 0:
        raise ValueError("texts is an empty list; give at least one text")
    batch: list[str | tuple[str, str]] = []
    if text_pairs is not None:
        if len(text_pairs) != len(texts):
            raise ValueError(f"got {len(texts)} texts but {len(text_pairs)} text_pairs; "
                             "give one pair per text")
        for i, (a, b) in enumerate(zip(texts, text_pairs, strict=True)):
            batch.append((_check_text(a, f"text {i}"), _check_text(b, f"text_pair {i}")))
        return batch
    for i, t in enumerate(texts):
        if isinstance(t, tuple):
            if len(t) != 2:
                raise ValueError(f"text {i} is a tuple of {len(t)}; a pair is (text, text_pair)")
            batch.append((_check_text(t[0], f"text {i}[0]"), _check_text(t[1], f"text {i}[1]")))
        else:
            batch.append(_check_text(t, f"text {i}"))
    return batch


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}
