"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF file carries no ``tokenizer.json``: it stores the vocabulary (``tokens``, one string per
id), per-token ``token_type`` and ``scores``, BPE ``merges`` for byte-level vocabularies, the
special ids and a few flags. Two kinds cover the files people run:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE (SmolLM2, Qwen, Llama 3). Every byte of
  the UTF-8 text is first spelled as one printable character (GPT-2's byte alphabet: space is
  ``Ġ``, newline ``Ċ``), the text is split into words by the regular expression that
  ``tokenizer.ggml.pre`` names, and the merges apply in the file's order.
- ``tokenizer.ggml.model == "llama"``: SentencePiece BPE with byte fallback (Gemma, Llama 2).
  Spaces become ``▁`` (with a ``▁`` in front of the text when ``add_space_prefix`` says so),
  pieces merge by the score of the piece they make (a GGUF lists no merges; they are
  recovered from the vocabulary), and a character that no piece covers becomes its UTF-8
  bytes, the tokens ``<0x00>`` ... ``<0xFF>``.

Tokens of type CONTROL (3) are special: kept whole in the text, dropped by
``decode(..., skip_special_tokens=True)``; USER_DEFINED (4) tokens (Gemma's ``\\n\\n``,
``<table>``) are kept whole too but are ordinary text.

The result equals transformers' GGUF tokenizer on the two shipped files; where the two differ
on other files, this follows the file (docs/tokenizers.md lists the differences).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from handformer.weights import CheckpointError

__all__ = ["GGUFVocab", "read_gguf_vocab", "build_gguf_tokenizer", "byte_alphabet",
           "PRE_TOKENIZER_SPLITS"]

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODELS = ("gpt2", "llama")
SPACE = "\u2581"  # "▁", SentencePiece's visible space
# Architectures whose SentencePiece files follow Gemma's conventions: no space prefix, runs of
# spaces stored as real spaces, merge order = the order of the pieces in the file.
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3n")

# The word-splitting expressions of byte-level vocabularies, by ``tokenizer.ggml.pre``
# (llama.cpp's names). None = GPT-2's own expression (the ByteLevel pre-tokenizer's);
# "digits" = GPT-2's, after splitting every digit on its own (StarCoder / SmolLM).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


class GGUFVocab:
    """The tokenizer fields of a GGUF file's metadata, read and checked.

    Attributes:
        model: ``"gpt2"`` or ``"llama"``.
        pre: ``tokenizer.ggml.pre`` (``"default"`` when absent).
        architecture: ``general.architecture`` (``""`` when absent).
        tokens, token_types, scores, merges: the per-token arrays (``scores`` None when absent,
            ``merges`` None when absent), ``token_types`` all NORMAL when absent.
        bos_id, eos_id, unk_id, pad_id: special ids or None; ``eot_ids``: end-of-turn ids
            (``eot_token_id``, ``eom_token_id``) that also end generation.
        add_bos, add_eos, add_space_prefix: the flags, with llama.cpp's defaults.
        chat_template: ``tokenizer.chat_template`` or None.
    """

    def __init__(self, metadata: Mapping[str, object], source: str) -> None:
        self.source = source

        def get(key: str, default: object = None) -> object:
            return _scalar(metadata.get(key, default))

        model = get("tokenizer.ggml.model")
        if model is None:
            raise CheckpointError(f"{source}: tokenizer.ggml.model is missing; the file holds "
                                  "no tokenizer (load it with tokenizer=False)")
        model = self._string(model, "tokenizer.ggml.model")
        if model not in MODELS:
            raise CheckpointError(f"{source}: tokenizer.ggml.model is {model!r}; supported: "
                                  f"{', '.join(MODELS)}")
        self.model = str(model)
        self.pre = self._string(get("tokenizer.ggml.pre", "default"), "tokenizer.ggml.pre")
        architecture = get("general.architecture")
        self.architecture = ("" if architecture is None
                             else self._string(architecture, "general.architecture"))
        self.tokens = self._strings(get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")
        V = len(self.tokens)
        types = get("tokenizer.ggml.token_type")
        self.token_types = ([NORMAL] * V if types is None
                            else self._numbers(types, "tokenizer.ggml.token_type", V, int))
        scores = get("tokenizer.ggml.scores")
        self.scores = (None if scores is None
                       else self._numbers(scores, "tokenizer.ggml.scores", V, float))
        merges = get("tokenizer.ggml.merges")
        self.merges = None if merges is None else self._merges(merges)
        if self.model == "gpt2" and self.merges is None:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges is missing; a byte-level "
                                  "BPE vocabulary (tokenizer.ggml.model 'gpt2') needs its merges")
        self.dropped: set[str] = set()  # special ids outside the vocabulary, left out
        self.bos_id = self._id(get, "tokenizer.ggml.bos_token_id")
        self.eos_id = self._id(get, "tokenizer.ggml.eos_token_id")
        self.unk_id = self._id(get, "tokenizer.ggml.unknown_token_id")
        self.pad_id = self._id(get, "tokenizer.ggml.padding_token_id")
        self.eot_ids = [i for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                        if (i := self._id(get, key)) is not None]
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        self.add_bos = self._flag(get, "tokenizer.ggml.add_bos_token", self.model == "llama")
        self.add_eos = self._flag(get, "tokenizer.ggml.add_eos_token", False)
        self.add_space_prefix = self._flag(
            get, "tokenizer.ggml.add_space_prefix",
            self.model == "llama" and self.architecture not in GEMMA_ARCHITECTURES)
        for flag, wanted, token_id in (("bos", self.add_bos, self.bos_id),
                                       ("eos", self.add_eos, self.eos_id)):
            if wanted and token_id is None and f"tokenizer.ggml.{flag}_token_id" not in \
                    self.dropped:  # (a dropped id is not added: its warning says so)
                raise CheckpointError(f"{source}: tokenizer.ggml.add_{flag}_token is true but the "
                                      f"file has no tokenizer.ggml.{flag}_token_id")
        self.add_bos = self.add_bos and self.bos_id is not None
        self.add_eos = self.add_eos and self.eos_id is not None
        template = get("tokenizer.chat_template")
        self.chat_template = (None if template is None
                              else self._string(template, "tokenizer.chat_template"))

    # -- checks: every field of an untrusted file, with one line naming it ------------------

    def _string(self, value: object, key: str) -> str:
        if isinstance(value, bytes):
            value = self._utf8(value, key)
        if not isinstance(value, str):
            raise CheckpointError(f"{self.source}: {key} must be a string, got "
                                  f"{type(value).__name__}")
        return value

    def _utf8(self, value: bytes, key: str) -> str:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.source}: {key} holds bytes that are not UTF-8: "
                                  f"{value[:40]!r}") from None

    def _strings(self, value: object, key: str) -> list[str]:
        if value is None:
            raise CheckpointError(f"{self.source}: {key} is missing")
        items = _as_list(value)
        if items is None or not items:
            raise CheckpointError(f"{self.source}: {key} must be a non-empty array of strings, "
                                  f"got {type(value).__name__}")
        out = []
        for i, item in enumerate(items):
            if isinstance(item, bytes):
                item = self._utf8(item, f"{key}[{i}]")
            if not isinstance(item, str):
                raise CheckpointError(f"{self.source}: {key}[{i}] must be a string, got "
                                      f"{type(item).__name__}")
            out.append(item)
        return out

    def _numbers(self, value: object, key: str, n: int, kind: type) -> list:
        items = _as_list(value)
        if items is None:
            raise CheckpointError(f"{self.source}: {key} must be an array, got "
                                  f"{type(value).__name__}")
        if len(items) != n:
            raise CheckpointError(f"{self.source}: {key} has {len(items)} entries but "
                                  f"tokenizer.ggml.tokens has {n}")
        items = [_scalar(x) for x in items]
        bad = next((i for i, x in enumerate(items)
                    if isinstance(x, bool) or not isinstance(x, (int, float))
                    or (kind is int and x != int(x))), None)
        if bad is not None:
            raise CheckpointError(f"{self.source}: {key}[{bad}] must be a number, got "
                                  f"{items[bad]!r:.40}")
        return [kind(x) for x in items]

    def _merges(self, value: object) -> list[tuple[str, str]]:
        key = "tokenizer.ggml.merges"
        pairs = []
        for i, merge in enumerate(self._strings(value, key)):
            parts = merge.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise CheckpointError(f"{self.source}: {key}[{i}] must be two tokens separated "
                                      f"by one space, got {merge!r:.60}")
            pairs.append((parts[0], parts[1]))
        return pairs

    def _id(self, get: object, key: str) -> int | None:
        value = get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.source}: {key} must be an integer, got {value!r:.40}")
        if not 0 <= value < len(self.tokens):
            if value not in (-1, 0xFFFFFFFF):  # llama.cpp's "none": left out quietly
                # llama.cpp leaves such an id out too (with a warning), and loads the file.
                warnings.warn(f"{self.source}: {key} is {value}, outside the vocabulary of "
                              f"{len(self.tokens)} tokens; left out", stacklevel=4)
                self.dropped.add(key)
            return None
        return value

    def _flag(self, get: object, key: str, default: bool) -> bool:
        value = get(key)
        if value is None:
            return default
        if not isinstance(value, (bool, int)):
            raise CheckpointError(f"{self.source}: {key} must be true or false, got "
                                  f"{value!r:.40}")
        return bool(value)


def _as_list(value: object) -> list | None:
    """A list from a sequence or a 1-D numpy array (None for anything else, strings too)."""
    if hasattr(value, "ndim") and callable(getattr(value, "tolist", None)):
        return value.tolist() if value.ndim == 1 else None
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return None


def _scalar(value: object) -> object:
    """A numpy scalar (or 0-d array) as the Python value; anything else unchanged."""
    if hasattr(value, "ndim") and value.ndim == 0 and callable(getattr(value, "item", None)):
        return value.item()
    return value


def read_gguf_vocab(metadata: Mapping[str, object], *, source: str) -> GGUFVocab:
    """Read and check the tokenizer fields of a GGUF file's metadata (see :class:`GGUFVocab`).

    Raises:
        CheckpointError: naming ``source`` and the field, for a missing or malformed field.
    """
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict (key -> value), got {type(metadata).__name__}")
    return GGUFVocab(metadata, source)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the other
    68 bytes (controls, space, ...) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def build_gguf_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` a :class:`GGUFVocab` describes (special tokens registered;
    BOS / EOS are added by :class:`~handformer.pretrained.LMTokenizer`, not by this object)."""
    if vocab.model == "gpt2":
        tokenizer, spelled = _byte_level(vocab)
    else:
        tokenizer, spelled = _sentencepiece(vocab)
    _register_special_tokens(tokenizer, vocab, spelled)
    return tokenizer


def _byte_level(vocab: GGUFVocab) -> tuple[Tokenizer, list[str]]:
    """Byte-level BPE. A token holding a character outside the byte alphabet (a file that
    spells ``"\\n"`` as itself rather than ``"Ċ"``) is respelled byte by byte."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
               for t in vocab.tokens]
    ids = _vocab_dict(spelled)
    unknown = next(((i, m) for i, m in enumerate(vocab.merges)
                    if m[0] not in ids or m[1] not in ids or m[0] + m[1] not in ids), None)
    if unknown is not None:
        raise CheckpointError(f"{vocab.source}: tokenizer.ggml.merges[{unknown[0]}] "
                              f"{' '.join(unknown[1])!r} joins tokens that are not in "
                              "tokenizer.ggml.tokens")
    tokenizer = Tokenizer(models.BPE(ids, vocab.merges, fuse_unk=False, dropout=None))
    split = PRE_TOKENIZER_SPLITS.get(vocab.pre, "unknown")
    if split == "unknown":
        warnings.warn(f"{vocab.source}: tokenizer.ggml.pre {vocab.pre!r} is not one handformer "
                      "knows; text is split into words as GPT-2 does, which may differ from "
                      "the model's own tokenizer on some texts", stacklevel=4)
        split = None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None
                                          or split == "digits")
    if split is None:
        tokenizer.pre_tokenizer = byte_level
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, spelled


def _sentencepiece(vocab: GGUFVocab) -> tuple[Tokenizer, list[str]]:
    """SentencePiece BPE with byte fallback, merges recovered from the vocabulary."""
    gemma = vocab.architecture in GEMMA_ARCHITECTURES
    spelled = list(vocab.tokens)
    if gemma:  # Gemma stores its runs of spaces as real spaces; the model reads them as "▁"s
        spelled = [SPACE * len(t) if t and not t.strip(" ") else t for t in spelled]
    ids = _vocab_dict(spelled)
    if gemma or vocab.scores is None:
        ranks = [-float(i) for i in range(len(spelled))]  # earlier in the file = merged first
    else:
        ranks = vocab.scores
    merges = sentencepiece_merges(spelled, ids, ranks)
    unk = spelled[vocab.unk_id] if vocab.unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(ids, merges, unk_token=unk, fuse_unk=True,
                                     byte_fallback=True, dropout=None))
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    replace = normalizers.Replace(" ", SPACE)
    if vocab.add_space_prefix:
        # llama.cpp puts a space before the text and after every special or user-defined
        # token, whether or not the text already starts with one; the normalizer runs on each
        # stretch of text between such tokens, so Prepend does exactly that.
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace])
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        tokenizer.normalizer = replace
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, spelled


def sentencepiece_merges(tokens: Sequence[str], ids: Mapping[str, int],
                         ranks: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every way of cutting a piece in two halves that are both pieces is a merge. Merges rank by
    the ``ranks`` value of the piece they make (higher first), then by the longer left half,
    then the longer right half; remaining ties (pieces of equal rank) keep file order. A piece
    listed twice counts once, at its first place, with the rank of its last (the id the
    vocabulary keeps).
    """
    pieces: list[tuple[float, list[tuple[str, str]]]] = []  # (rank, its merges)
    seen: set[str] = set()
    for piece in tokens:
        if len(piece) < 2 or piece in seen:
            continue
        seen.add(piece)
        found = [(left, right) for k in range(len(piece) - 1, 0, -1)  # longest left first
                 if (left := piece[:k]) in ids and (right := piece[k:]) in ids]
        if found:
            pieces.append((ranks[ids[piece]], found))
    if all(a[0] > b[0] for a, b in zip(pieces, pieces[1:], strict=False)):
        # Ranks fall along the file (Gemma, Llama): already in order, no sort needed.
        return [m for _, found in pieces for m in found]
    flat = [(rank, len(left), len(right), left, right) for rank, found in pieces
            for left, right in found]
    flat.sort(key=lambda m: m[:3], reverse=True)  # stable: ties keep file order
    return [(m[3], m[4]) for m in flat]


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id (a token listed twice keeps its last id, as a dict built in order does)."""
    return {t: i for i, t in enumerate(tokens)}


def _register_special_tokens(tokenizer: Tokenizer, vocab: GGUFVocab, spelled: list[str]) -> None:
    """CONTROL tokens (and BOS/EOS/UNK/PAD) become special added tokens, USER_DEFINED ones
    plain added tokens: both are matched whole in the text, before any splitting.

    In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet is a mislabel
    of the file's converter (it was respelled above); it is not registered.
    """
    known = tokenizer.get_vocab()
    alphabet = set(byte_alphabet().values()) if vocab.model == "gpt2" else None
    special_ids = {i for i in (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id,
                               *vocab.eot_ids) if i is not None}
    control, user = [], []
    for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if kind == CONTROL or i in special_ids:
            if (alphabet is None or set(token) <= alphabet) and known.get(spelled[i]) == i:
                control.append(AddedToken(spelled[i], special=True, normalized=False))
        elif kind == USER_DEFINED and known.get(token) == i:
            user.append(AddedToken(token, special=False, normalized=False))
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)
