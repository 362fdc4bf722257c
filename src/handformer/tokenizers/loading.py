"""Which tokenizer a checkpoint folder has: the one place that decides.

:func:`folder_tokenizer` is what :func:`~handformer.pretrained.load_lm` gives back beside the
model, and :func:`require_tokenizer` is what the commands and the server say when there is
none. In the order tried:

* a folder of another family with ``tokenizer.json``: an
  :class:`~handformer.tokenizers.lm.LMTokenizer` (with the folder's special tokens and chat
  template);
* a GPT-2 folder or a ``handformer train`` run with ``tokenizer.json``, or GPT-2's
  ``vocab.json`` + ``merges.txt``: a :class:`~handformer.tokenizers.byte_bpe.TextTokenizer`;
* a ``handformer train`` run's character ``vocab.json``: a
  :class:`~handformer.tokenizers.chars.CharVocab`;
* else none.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from handformer.models.causal_lm import MODEL_TYPE
from handformer.tokenizers.byte_bpe import TextTokenizer, missing_tokenizer_note
from handformer.tokenizers.chars import VOCAB_NAME, CharVocab, is_char_vocab
from handformer.tokenizers.lm import LMTokenizer

__all__ = ["folder_tokenizer", "require_tokenizer", "eos_token_id"]

_TEXT_TOKENIZER_TYPES = ("gpt2", MODEL_TYPE)  # GPT-2's conventions: GPT-2, handformer runs


def folder_tokenizer(folder: str | os.PathLike, config: Mapping[str, object]) -> object | None:
    """The tokenizer of a checkpoint folder, or None when it has none (the module docstring
    lists what is tried, in order).

    Args:
        folder: the checkpoint folder.
        config: its ``config.json`` (``model_type`` and ``eos_token_id`` are read).

    Returns:
        A tokenizer of the protocol, or None.

    Raises:
        ValueError: for tokenizer files that cannot be read.
    """
    folder = Path(folder)
    if (config.get("model_type") not in _TEXT_TOKENIZER_TYPES
            and (folder / "tokenizer.json").is_file()):
        return LMTokenizer.from_folder(folder)
    tokenizer = TextTokenizer.from_dir(folder, eos_token_id=eos_token_id(folder, config))
    if tokenizer is None and is_char_vocab(folder / VOCAB_NAME):
        return CharVocab.load(folder / VOCAB_NAME)
    return tokenizer


def require_tokenizer(tokenizer: object | None, folder: str | os.PathLike) -> object:
    """``tokenizer``, or a one-line error saying which files ``folder`` lacks.

    Args:
        tokenizer: what :func:`folder_tokenizer` found.
        folder: the folder it looked in.

    Returns:
        ``tokenizer``, when it is not None.

    Raises:
        ValueError: when it is None.
    """
    if tokenizer is None:
        raise ValueError(f"{missing_tokenizer_note(folder)}; nor a character {VOCAB_NAME} "
                         "(handformer train's): add the model's tokenizer files")
    return tokenizer


def eos_token_id(folder: str | os.PathLike, config: Mapping[str, object]) -> int | None:
    """The end-of-text id: ``generation_config.json``'s, else ``config.json``'s (the first
    of a list), else None.

    Args:
        folder: the checkpoint folder.
        config: its ``config.json``.

    Returns:
        The id, or None.
    """
    eos = config.get("eos_token_id")
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id", eos)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None
