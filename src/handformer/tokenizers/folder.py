"""Reading a Hugging Face model folder's tokenizer files for :class:`LMTokenizer`.

Files, in the order they are trusted:

- ``tokenizer.json`` (the ``tokenizers`` library's file), else GPT-2's ``vocab.json`` +
  ``merges.txt``;
- ``tokenizer_config.json``: ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token``
  (strings or ``{"content": ...}``), ``add_bos_token`` / ``add_eos_token``,
  ``chat_template``; ``special_tokens_map.json`` fills in token names it lacks;
- ``generation_config.json``: ``eos_token_id`` (one id or a list: every id that ends
  generation), ``bos_token_id``, ``pad_token_id`` where the tokenizer files name none;
- ``chat_template.jinja`` or ``chat_template.json`` (newer transformers save the template
  there).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_folder", "read_json", "byte_level_bpe", "keep_vocabulary_ids"]

EOS_TOKEN = "<|endoftext|>"

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def keep_vocabulary_ids(options: dict[str, object], size: int, source: str) -> dict[str, object]:
    """Leave out the special ids of :class:`LMTokenizer` keyword arguments that are not ids of
    a ``size``-token vocabulary, with one warning line naming them (transformers loads such
    folders too: a retrained vocabulary under config.json's default GPT-2 ids, 50256).

    Returns:
        ``options``, changed in place: bad ids None or dropped from ``eos_token_ids``, and
        ``add_bos_token`` / ``add_eos_token`` off where their id went.
    """
    def valid(i: object) -> bool:
        return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size

    dropped = []
    for key in ("bos_token_id", "pad_token_id", "unk_token_id"):
        if options.get(key) is not None and not valid(options[key]):
            dropped.append(f"{key} {options[key]}")
            options[key] = None
    eos = list(options.get("eos_token_ids") or [])
    dropped += [f"eos_token_id {i}" for i in dict.fromkeys(i for i in eos if not valid(i))]
    options["eos_token_ids"] = [i for i in eos if valid(i)]
    if dropped:
        import warnings

        warnings.warn(f"{source}: special token ids outside the vocabulary (0 ... {size - 1}) "
                      f"left out: {', '.join(dropped)}", stacklevel=4)
    options["add_bos_token"] = bool(options.get("add_bos_token")) and \
        options.get("bos_token_id") is not None
    options["add_eos_token"] = bool(options.get("add_eos_token")) and bool(
        options["eos_token_ids"])
    return options


def read_folder(folder: Path, *, eos_first: int | None = None) -> dict[str, object]:
    """The keyword arguments of :class:`LMTokenizer` for a model folder (``eos_first``: an
    EOS id to put first, e.g. config.json's). Special ids that are not ids of the vocabulary
    are left out with a one-line warning (:func:`keep_vocabulary_ids`).

    Raises:
        FileNotFoundError: if the folder has no tokenizer files.
        ValueError: naming the file, for one that cannot be read.
    """
    tokenizer = _backend(folder)
    config = read_json(folder / "tokenizer_config.json")
    names = read_json(folder / "special_tokens_map.json")
    generation = read_json(folder / "generation_config.json")
    ids: dict[str, int | None] = {}
    for key in SPECIAL_KEYS:
        name = _content(config.get(key)) or _content(names.get(key))
        ids[key] = tokenizer.token_to_id(name) if name else None
    for key in ("bos_token", "pad_token"):
        if ids[key] is None:
            ids[key] = _one_id(generation.get(f"{key}_id"))
    eos = [ids["eos_token"]] + _id_list(generation.get("eos_token_id"))
    eos = [i for i in eos if i is not None]

    # What tokenizer.json's post-processor adds, seen on a one-letter text.
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    extra = len(full) - len(plain)
    adds_bos = extra > 0 and ids["bos_token"] is not None and full[0] == ids["bos_token"]
    adds_eos = extra > 0 and bool(eos) and full[-1] == eos[0] and plain[-1:] != full[-1:]
    want_bos = config.get("add_bos_token", adds_bos)
    want_eos = config.get("add_eos_token", adds_eos)
    add_bos = add_eos = False
    if (bool(want_bos), bool(want_eos)) != (adds_bos, adds_eos):
        # tokenizer_config.json says otherwise: it wins (as transformers' Llama tokenizer
        # classes rebuild their post-processor from the flags); BOS / EOS are
        # then added by LMTokenizer and the post-processor is dropped.
        tokenizer.post_processor = None
        add_bos = bool(want_bos) and ids["bos_token"] is not None
        add_eos = bool(want_eos) and bool(eos)
    eos = ([] if eos_first is None else [eos_first]) + eos
    options = {"tokenizer": tokenizer, "bos_token_id": ids["bos_token"], "eos_token_ids": eos,
               "pad_token_id": ids["pad_token"], "unk_token_id": ids["unk_token"],
               "add_bos_token": add_bos, "add_eos_token": add_eos,
               "chat_template": _chat_template(folder, config), "name": str(folder)}
    return keep_vocabulary_ids(options, tokenizer.get_vocab_size(with_added_tokens=True),
                               str(folder))


def _backend(folder: Path) -> object:
    """The folder's ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path}: not a readable tokenizers file ({exc})") from None
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return byte_level_bpe(folder / "vocab.json", folder / "merges.txt")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    raise FileNotFoundError(f"{folder} has no tokenizer: expected tokenizer.json, or "
                            "vocab.json + merges.txt")


def _content(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _one_id(value: object) -> int | None:
    found = _id_list(value)
    return found[0] if found else None


def _id_list(value: object) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _chat_template(folder: Path, config: dict) -> str | None:
    """The folder's chat template (a named list picks ``"default"``, else the first)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = read_json(folder / "chat_template.json").get("chat_template",
                                                           config.get("chat_template"))
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) and template else None


def read_json(path: Path) -> dict:
    """A JSON object file, or {} when absent.

    Raises:
        ValueError: naming the file, if it is not a JSON object.
    """
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


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
