"""The tokenizer of a causal language model: a folder's ``tokenizer.json`` or a GGUF file's
metadata, on the ``tokenizers`` library, speaking the one protocol
(:class:`~handformer.tokenizers.protocol.Tokenizer`)::

    tok = LMTokenizer.from_folder("SmolLM2-135M-Instruct/")
    tok = LMTokenizer.from_gguf_metadata(read_gguf(path).metadata, source=path)
    tok.encode("Hello")                       # BOS first when the model wants one
    tok(["a", "longer text"])                 # left-padded (1 = real token)
    tok.apply_chat_template([{"role": "user", "content": "Hi"}])

Shape letters: ``B`` batch, ``L`` length.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import Tensor

from handformer.tokenizers.protocol import TokenizerMethods, check_ids

__all__ = ["LMTokenizer"]


class LMTokenizer(TokenizerMethods):
    """A ``tokenizers.Tokenizer`` with its special tokens and chat template.

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` (its post-processor, if any, adds special
            tokens; ``add_bos_token`` / ``add_eos_token`` add them here instead).
        bos_token_id, pad_token_id, unk_token_id: special ids, or None.
        eos_token_ids: every id that ends generation, the main EOS first.
        add_bos_token, add_eos_token: put BOS first / EOS last when ``encode`` is asked to
            add special tokens.
        chat_template: a Jinja chat template, or None.
        name: where it came from, for messages.

    Raises:
        ValueError: for a special id outside the vocabulary, or a flag set without its id.
    """

    padding_side = "left"

    def __init__(self, tokenizer: object, *, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = (), pad_token_id: int | None = None,
                 unk_token_id: int | None = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, chat_template: str | None = None,
                 name: str = "tokenizer") -> None:
        self.tokenizer = tokenizer
        self.name = name
        size = len(self)
        for what, value in (("bos_token_id", bos_token_id), ("pad_token_id", pad_token_id),
                            ("unk_token_id", unk_token_id),
                            *(("eos_token_ids", i) for i in eos_token_ids)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < size):
                raise ValueError(f"{name}: {what} {value!r} is not an id of the vocabulary "
                                 f"(0 ... {size - 1})")
        if add_bos_token and bos_token_id is None:
            raise ValueError(f"{name}: add_bos_token=True needs a bos_token_id")
        if add_eos_token and not eos_token_ids:
            raise ValueError(f"{name}: add_eos_token=True needs an eos token id")
        self._bos, self._pad, self._unk = bos_token_id, pad_token_id, unk_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self.chat_template = chat_template

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> LMTokenizer:
        """The tokenizer of a Hugging Face model folder.

        Reads ``tokenizer.json`` (or GPT-2's ``vocab.json`` + ``merges.txt``); the special
        tokens from ``tokenizer_config.json`` (then ``special_tokens_map.json``); whether BOS /
        EOS are added from ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token``
        when it says (else as ``tokenizer.json``'s post-processor does); the EOS ids that end
        generation from ``generation_config.json`` too; the chat template from
        ``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``.

        Raises:
            FileNotFoundError: if the folder has no tokenizer files.
            ValueError: for files that cannot be read.
        """
        from handformer.tokenizers.folder import read_folder

        return cls(**read_folder(Path(path)))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, object], *, source: str | os.PathLike
                           ) -> LMTokenizer:
        """The tokenizer a GGUF file's ``tokenizer.ggml.*`` metadata describes.

        Args:
            metadata: the file's metadata, key -> value (arrays as lists).
            source: the file, named in messages.

        Raises:
            CheckpointError: naming ``source`` and the field, for a missing or malformed one
                or a tokenizer model other than ``gpt2`` / ``llama``.
        """
        from handformer.tokenizers.gguf_vocab import build_gguf_tokenizer, read_gguf_vocab

        vocab = read_gguf_vocab(metadata, source=str(source))
        eos = [i for i in (vocab.eos_id, *vocab.eot_ids) if i is not None]
        return cls(build_gguf_tokenizer(vocab), bos_token_id=vocab.bos_id, eos_token_ids=eos,
                   pad_token_id=vocab.pad_id, unk_token_id=vocab.unk_id,
                   add_bos_token=vocab.add_bos, add_eos_token=vocab.add_eos,
                   chat_template=vocab.chat_template, name=str(source))

    # -- the protocol -----------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None."""
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        """The main end-of-sequence id (the first of :attr:`eos_token_ids`), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, or None (padding then writes EOS, masked out)."""
        return self._pad

    @property
    def unk_token_id(self) -> int | None:
        """The unknown-token id, or None."""
        return self._unk

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with BOS / EOS as the model expects when
        ``add_special_tokens``. Special tokens written in the text (``<|im_start|>``) are read
        as those tokens.

        Raises:
            TypeError: if ``text`` is not a string.
            ValueError: if it holds lone surrogates (bytes that were not UTF-8).
        """
        from handformer.tokenizers.wordpiece import check_unicode

        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}: {text!r:.60}")
        check_unicode(text, "text")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token:
                ids = [self._bos, *ids]
            if self.add_eos_token:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int] | Tensor, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (special tokens dropped with ``skip_special_tokens``).

        Raises:
            ValueError: for an id outside the vocabulary.
        """
        ids = check_ids(ids, len(self))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary string of id ``i``."""
        token = self.tokenizer.id_to_token(int(i))
        if token is None:
            raise ValueError(f"id {i} is not in the vocabulary of {len(self)} tokens")
        return token

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary string, or None."""
        return self.tokenizer.token_to_id(token)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """The conversation as the model's prompt text, rendered by its chat template in a
        sandbox (:func:`~handformer.chat.template.render_chat_template`).

        Encode the result with ``encode(text, add_special_tokens=False)`` when the template
        writes BOS itself (``"{{ bos_token }}"``), as Gemma's instruction templates do.

        Raises:
            ValueError: if the model has no chat template, for malformed messages, or for a
                template that fails, reaches outside its sandbox or goes over its budget (a
                :class:`~handformer.chat.template.ChatTemplateError` naming the
                file).
        """
        from handformer.chat.template import render_chat_template

        if not self.chat_template:
            raise ValueError(f"{self.name} has no chat template (a base model, not an "
                             "instruction-tuned one); pass the prompt as plain text instead")
        special = {"bos_token": self._token(self._bos), "eos_token": self._token(self.eos_token_id),
                   "pad_token": self._token(self._pad), "unk_token": self._token(self._unk)}
        return render_chat_template(self.chat_template, messages, source=self.name,
                                    add_generation_prompt=add_generation_prompt, **special)

    def _token(self, i: int | None) -> str:
        return "" if i is None else self.tokenizer.id_to_token(i) or ""

    def __repr__(self) -> str:
        return (f"LMTokenizer({self.name!r}, vocab={len(self)}, bos={self._bos}, "
                f"eos={self.eos_token_ids}, add_bos={self.add_bos_token})")

