"""GPT-2's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, or GPT-2's
byte-level BPE rebuilt from ``vocab.json`` + ``merges.txt`` (the files of transformers'
``GPT2Tokenizer``).

:class:`TextTokenizer` is an :class:`~handformer.pretrained.LMTokenizer` (the one tokenizer
protocol: ``tok(texts)``, ``encode``, ``decode``, ``tokens``, ``to_tokens`` ...) whose
end-of-text token is ``<|endoftext|>`` unless the folder names another. Anything speaking
the protocol can take its place (the ``generate`` command also accepts a character vocabulary
``vocab.json`` written by the trainer).
"""

from __future__ import annotations

import os
from pathlib import Path

from handformer.tokenizers.folder import EOS_TOKEN, byte_level_bpe, read_folder
from handformer.tokenizers.lm import LMTokenizer

__all__ = ["TextTokenizer", "byte_level_bpe", "missing_tokenizer_note"]

TOKENIZER_NAME = "tokenizer.json"
BPE_FILES = ("vocab.json", "merges.txt")


class TextTokenizer(LMTokenizer):
    """A causal language model's ``tokenizers.Tokenizer`` with GPT-2's conventions.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        eos_token_id: the end-of-text id, or None; it is also the BOS id (GPT-2 uses
            ``<|endoftext|>`` for both) but is never added by :meth:`encode`.
    """

    def __init__(self, tokenizer: object, *, eos_token_id: int | None = None, **options: object
                 ) -> None:
        if "eos_token_ids" not in options:
            options["eos_token_ids"] = [] if eos_token_id is None else [eos_token_id]
        options.setdefault("bos_token_id", eos_token_id)
        super().__init__(tokenizer, **options)

    @classmethod
    def from_dir(cls, folder: str | os.PathLike, *, eos_token_id: int | None = None
                 ) -> TextTokenizer | None:
        """The folder's tokenizer as a :class:`TextTokenizer`, or None without one.

        ``tokenizer.json`` is preferred; else ``vocab.json`` + ``merges.txt`` make GPT-2's
        byte-level BPE (:func:`byte_level_bpe`). Special tokens as
        :meth:`LMTokenizer.from_folder` reads them; ``eos_token_id`` (e.g. ``config.json``'s)
        comes first among the EOS ids, and ``<|endoftext|>`` is the EOS when nothing names
        one. Special ids that are not ids of the vocabulary (config.json's GPT-2 defaults
        under a retrained vocabulary) are left out with a one-line warning, as transformers
        loads such folders. :func:`missing_tokenizer_note` says what is missing when this
        returns None.

        Raises:
            ValueError: if the tokenizer files exist but cannot be read.
        """
        folder = Path(folder)
        vocab, merges = (folder / name for name in BPE_FILES)
        if not ((folder / TOKENIZER_NAME).is_file() or (vocab.is_file() and merges.is_file())):
            return None
        options = read_folder(folder, eos_first=eos_token_id)  # ids beyond the vocabulary:
        tokenizer = options.pop("tokenizer")  # left out there, with a warning
        eos = list(options.pop("eos_token_ids"))
        if not eos and tokenizer.token_to_id(EOS_TOKEN) is not None:
            eos = [tokenizer.token_to_id(EOS_TOKEN)]
        if options["bos_token_id"] is None and eos:
            options["bos_token_id"] = eos[0]
        return cls(tokenizer, eos_token_ids=eos, **options)


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
