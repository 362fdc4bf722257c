"""How tokens are shown: one label per token, the same in PNGs, the viewer, the page and the API.

Byte-level tokenizers (GPT-2, SmolLM2, Qwen, Llama 3: byte-level BPE; Gemma, Llama 2:
SentencePiece with ``<0x..>`` byte-fallback tokens) split a character they have no token for
into its UTF-8 bytes, so one Chinese character may be two or three tokens, and a token may end
in the middle of a character. Decoded alone such a token is ``"\\ufffd"``. :func:`token_labels`
keeps every token (its own row and column) but labels it with the whole character it belongs
to and its share: the first of two tokens of 动 is ``"动·1/2"``, the second ``"动·2/2"``. The
first bytes of a character whose end is not there (a text cut in the middle of one, or a
next-token candidate that starts a character the tokens after it would finish) are labelled
by their share of its bytes and their values, ``"byte 1/3 of a character (E5)"``; a byte
that belongs to no character at all is ``"<0xE5>"``. Spaces, line breaks and tabs inside a
token are made visible (``␣``, ``↵``, ``⇥``). :func:`next_token_labels` labels next-token
candidates the same way, in the context of the text they would continue: every list of top
tokens (the page's, the attribution's, the command line's) uses it.

:func:`unknown_notice` is the one line shown when a model does not know a text's script (more
than a tenth of its tokens are the unknown token), and :class:`TextStream` turns generated
tokens into text without ever emitting half a character.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["token_labels", "next_token_labels", "visible", "unk_token_id", "count_unknown",
           "unknown_notice",
           "texts_unknown_notice", "UNKNOWN_SHARE", "MULTILINGUAL_MODEL", "LM_ADVICE",
           "ENCODER_ADVICE", "TextStream", "label_words"]

UNKNOWN_SHARE = 0.1  # more than this share of unknown tokens gives a notice
MULTILINGUAL_MODEL = "gemma3-270m"  # the shipped model that reads Chinese and most scripts
# What the notice suggests: where a causal LM will do (viz, the page) and where an encoder is
# needed (embed, heads: sentence embeddings).
LM_ADVICE = f"the shipped {MULTILINGUAL_MODEL} does (--model {MULTILINGUAL_MODEL})"
ENCODER_ADVICE = (f"the shipped {MULTILINGUAL_MODEL} does (handformer viz --model "
                  f"{MULTILINGUAL_MODEL}); embeddings need a multilingual encoder (--model DIR)")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT = "\ufffd"


def visible(text: str) -> str:
    """Spaces, line breaks and tabs inside a token made visible (GPT-2 pieces start with one)."""
    return text.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: printable character -> byte.

    Bytes that are printable Latin-1 stand for themselves; the other 68 are mapped, in order,
    to the characters from U+0100 on.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in kept}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + extra)] = b
            extra += 1
    return table


_ALPHABET = _byte_level_alphabet()


def _raw_token(tokenizer: object, token_id: int) -> str | None:
    """The vocabulary's string for ``token_id`` (``id_to_token`` of the tokenizer or of the
    ``tokenizers.Tokenizer`` it wraps), or None."""
    for obj in (tokenizer, getattr(tokenizer, "tokenizer", None),
                getattr(tokenizer, "_tokenizer", None)):
        fn = getattr(obj, "id_to_token", None)
        if callable(fn):
            try:
                token = fn(int(token_id))
            except Exception:  # noqa: BLE001 - tokenizers raises bare exceptions
                continue
            if isinstance(token, str):
                return token
    return None


def _token_bytes(tokenizer: object, token_id: int) -> bytes | None:
    """The bytes a token that decodes to a partial character stands for, or None if its
    vocabulary string is neither a ``<0x..>`` byte token nor byte-level BPE."""
    raw = _raw_token(tokenizer, token_id)
    if raw is None:
        return None
    m = _BYTE_TOKEN.fullmatch(raw)
    if m is not None:
        return bytes([int(m.group(1), 16)])
    if raw and all(ch in _ALPHABET for ch in raw):
        return bytes(_ALPHABET[ch] for ch in raw)
    return None


def _utf8_chars(data: bytes, open_end: bool = True) -> list[tuple[int, int, str | None, int]]:
    """``data`` cut into characters: ``(start, end, char, size)``. ``char`` is None for a byte
    that starts no complete, valid UTF-8 sequence (``size`` 1), and, with ``open_end`` (what
    comes after ``data`` is not known), for the first bytes of a character that ``data`` ends
    before (``size`` the character's byte count, more than ``end - start``)."""
    out, i = [], 0
    while i < len(data):
        b = data[i]
        size = 1 if b < 0x80 else 2 if 0xC2 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else (
            4 if 0xF0 <= b < 0xF5 else 0)
        if size and i + size <= len(data):
            try:
                out.append((i, i + size, data[i:i + size].decode("utf-8"), size))
                i += size
                continue
            except UnicodeDecodeError:
                pass
        elif open_end and size > 1 and all(0x80 <= c < 0xC0 for c in data[i + 1:]):  # cut
            out.append((i, len(data), None, size))
            break
        out.append((i, i + 1, None, 1))
        i += 1
    return out


def _share(data: bytes, first: int, last: int, size: int) -> str:
    """``"byte 1/3 of a character (E5)"``: bytes ``first..last`` (from 1) of a character of
    ``size`` bytes whose end is not known; ``data`` holds them (their values tell two such
    tokens apart)."""
    span = f"byte {first}" if first == last else f"bytes {first}-{last}"
    return f"{span}/{size} of a character ({data.hex(' ').upper()})"


def _label_run(pieces: list[bytes], open_end: bool = True) -> list[str]:
    """Labels of consecutive tokens given by their bytes (see :func:`token_labels`);
    ``open_end``: nothing is known of what follows them (else a whole token does)."""
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    ends = [s + len(p) for s, p in zip(starts, pieces, strict=True)]
    data = b"".join(pieces)
    parts: list[list[tuple[str, str]]] = [[] for _ in pieces]  # (text, kind) per token
    for start, end, char, size in _utf8_chars(data, open_end):
        owners = [t for t in range(len(pieces)) if starts[t] < end and ends[t] > start]
        for n, t in enumerate(owners):
            if char is None and size > end - start:  # a character cut short
                first, last = max(start, starts[t]) - start + 1, min(end, ends[t]) - start
                piece = data[start + first - 1:start + last]
                parts[t].append((_share(piece, first, last, size), "share"))
            elif char is None:
                parts[t].append((f"<0x{data[start]:02X}>", "byte"))
            elif len(owners) == 1:
                parts[t].append((visible(char), "whole"))
            else:
                parts[t].append((f"{visible(char)}\u00b7{n + 1}/{len(owners)}", "piece"))
    labels = []
    for token_parts in parts:
        merged: list[str] = []
        last = None  # kind of the last part
        for text, kind in token_parts:
            if merged and kind == last and kind in ("whole", "byte"):
                merged[-1] += text  # whole characters stay one word, bytes one run
            else:
                merged.append(text)
            last = kind
        labels.append("+".join(merged) if merged else "")
    return labels


def token_labels(tokenizer: object, ids: Sequence[int]) -> list[str]:
    """One display label per token id: its text with spaces made visible, or, for a token
    holding part of a character, the whole character and its share (``"动·1/2"``).

    Args:
        tokenizer: anything with ``decode(ids)``; for byte-level tokens also ``id_to_token``
            (its own, or that of the ``tokenizers.Tokenizer`` in ``.tokenizer`` /
            ``._tokenizer``).
        ids: the token ids, in order (the characters split over neighbouring tokens are
            found within this sequence).

    Returns:
        ``len(ids)`` labels; none holds ``"\\ufffd"`` unless the vocabulary itself does.
    """
    ids = [int(i) for i in ids]
    texts = [tokenizer.decode([i]) for i in ids]
    labels: list[str] = [""] * len(ids)
    run: list[tuple[int, bytes]] = []

    def flush(open_end: bool = False) -> None:  # a whole token follows, unless at the end
        for (t, _), label in zip(run, _label_run([b for _, b in run], open_end), strict=True):
            labels[t] = label
        run.clear()

    for t, (i, text) in enumerate(zip(ids, texts, strict=True)):
        data = _token_bytes(tokenizer, i) if _REPLACEMENT in text else None
        if data is None:
            flush()
            labels[t] = visible(text).replace(_REPLACEMENT, "<?>")
        else:
            run.append((t, data))
    flush(open_end=True)
    return labels


def _pending(tokenizer: object, ids: Sequence[int], limit: int = 8) -> list[int]:
    """The last tokens of ``ids`` that hold pieces of characters (at most ``limit``): the
    run a next token may finish."""
    tail: list[int] = []
    for i in reversed([int(i) for i in ids][-limit:]):
        if _REPLACEMENT not in tokenizer.decode([i]) or _token_bytes(tokenizer, i) is None:
            break
        tail.insert(0, i)
    return tail


def next_token_labels(tokenizer: object, context: Sequence[int],
                      candidates: Sequence[int]) -> list[str]:
    """The label of each candidate next token after ``context``, as :func:`token_labels`
    would label it at the end of ``context``: a token that finishes a character the context
    started is ``"动·2/2"``, one that starts a character is ``"byte 1/3 of a character (E9)"``,
    never a raw ``"<0xE9>"`` or U+FFFD.

    Args:
        tokenizer: as for :func:`token_labels`.
        context: the token ids before the candidates (only the last few are read).
        candidates: the candidate ids, each labelled on its own after ``context``.

    Returns:
        One label per candidate.
    """
    tail = _pending(tokenizer, context)
    return [token_labels(tokenizer, [*tail, int(c)])[-1] for c in candidates]


_PIECE = re.compile(r"^.\u00b7(\d+)/\d+")  # "动·2/3": the 2nd token of a character


def label_words(labels: Sequence[str]) -> list[int]:
    """Per token, the index of the word it belongs to, read from :func:`token_labels`' labels
    (for "links between words" in :func:`handformer.viz.summarize`).

    A token starts a new word when it starts with a (visible) space or line break, or starts
    or follows a wide (CJK) character, which is a word of its own; the later pieces of one
    character (``"动·2/3"``) and subword pieces without a leading space stay in the word
    before them.

    Args:
        labels: the token labels.

    Returns:
        One word index per token, from 0.
    """
    import unicodedata

    def wide(ch: str) -> bool:
        return unicodedata.east_asian_width(ch) in ("W", "F")

    words: list[int] = []
    for t, label in enumerate(labels):
        m = _PIECE.match(label)
        if t == 0:
            new = True
        elif m is not None and int(m.group(1)) > 1:
            new = False
        else:
            prev = labels[t - 1]
            new = (not label or label[0] in "\u2423\u21b5\u21e5" or wide(label[0])
                   or (bool(prev) and wide(prev[-1])) or _PIECE.match(prev) is not None)
        words.append(words[-1] + 1 if words and new else (words[-1] if words else 0))
    return words


def unk_token_id(tokenizer: object) -> int | None:
    """The id of the tokenizer's unknown token (``unk_token_id``, else ``[UNK]`` or
    ``<unk>`` in its vocabulary), or None for a tokenizer without one (byte-level BPE)."""
    value = getattr(tokenizer, "unk_token_id", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    for obj in (tokenizer, getattr(tokenizer, "tokenizer", None),
                getattr(tokenizer, "_tokenizer", None)):
        fn = getattr(obj, "token_to_id", None)
        if callable(fn):
            for name in ("[UNK]", "<unk>"):
                found = fn(name)
                if isinstance(found, int):
                    return found
    return None


def count_unknown(tokenizer: object, ids: Sequence[int]) -> int:
    """How many of ``ids`` are the tokenizer's unknown token (0 without one)."""
    unk = unk_token_id(tokenizer)
    return 0 if unk is None else sum(1 for i in ids if int(i) == unk)


def unknown_notice(unknown: int, total: int, *, model: str, what: str = "the text",
                   advice: str = LM_ADVICE) -> str | None:
    """The one-line notice for a text the model cannot read, or None when at most
    :data:`UNKNOWN_SHARE` of its tokens are unknown.

    Args:
        unknown: tokens that are the unknown token.
        total: all tokens.
        model: the model's name.
        what: what was tokenized, e.g. ``"TEXT"`` or ``"text_pair"``.
        advice: which model reads it (:data:`LM_ADVICE` or :data:`ENCODER_ADVICE`).

    Returns:
        E.g. ``"11 of 14 tokens of the text are the unknown token: all-MiniLM-L6-v2 does not
        know this script; the shipped gemma3-270m does (--model gemma3-270m)"``.
    """
    if total <= 0 or unknown <= UNKNOWN_SHARE * total:
        return None
    return (f"{unknown} of {total} tokens of {what} are the unknown token: {model} does not "
            f"know this script; {advice}")


def texts_unknown_notice(tokenizer: object, texts: Sequence[str], *, model: str,
                         what: str = "the text", advice: str = LM_ADVICE) -> str | None:
    """:func:`unknown_notice` over several texts together (special tokens not counted).

    Args:
        tokenizer: a BERT-family tokenizer (``encode_batch([text])`` giving encodings with
            a special-token mask) or any other of the protocol (``encode(text)``: ids).
        texts: the texts.
        model, what, advice: as for :func:`unknown_notice`.

    Returns:
        The notice, or None.
    """
    import warnings

    unk = unk_token_id(tokenizer)
    if unk is None:
        return None
    unknown = total = 0
    for text in texts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a text cut to the model's limit
            if hasattr(tokenizer, "encode_batch"):  # BertTokenizer: with a special mask
                enc = tokenizer.encode_batch([text])[0]
                ids = [i for i, s in zip(enc.ids, enc.special_tokens_mask, strict=True)
                       if not s]
            else:
                ids = list(tokenizer.encode(text))
        unknown += sum(1 for i in ids if int(i) == unk)
        total += len(ids)
    return unknown_notice(unknown, total, model=model, what=what, advice=advice)


class TextStream:
    """Generated token ids in, text out, never half a character: while the text so far ends
    in an incomplete UTF-8 sequence (decoded as ``"\\ufffd"``), nothing is given out. Bytes
    that never became a character (a model can generate any byte sequence) are given out as
    ``"<?>"``; the tokens' labels (:func:`token_labels`) show them as ``"<0x..>"``.

    The whole sequence is decoded each time (as the ``generate`` command does), so decoders
    that depend on neighbours (SentencePiece's leading space) give the right text.

    Args:
        tokenizer: anything with ``decode(ids)``.
        skip: ids left out of the text (e.g. the end-of-text id).
    """

    def __init__(self, tokenizer: object, *, skip: Sequence[int] = ()) -> None:
        self.tokenizer, self.skip = tokenizer, {int(i) for i in skip}
        self.ids: list[int] = []
        self.sent = 0  # characters given out so far

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that is now complete (may be empty)."""
        if int(token_id) not in self.skip:
            self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith(_REPLACEMENT):
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new.replace(_REPLACEMENT, "<?>")

    def finish(self) -> str:
        """What is left at the end, without the bytes of a character cut short (the tokens'
        labels show them as ``"byte 1/3 of a character (E5)"``)."""
        text = self.tokenizer.decode(self.ids)
        rest = text[self.sent:].replace(_REPLACEMENT, "")
        self.sent = len(text)
        return rest
