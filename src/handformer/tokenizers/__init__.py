"""Tokenizers: text to token ids and back, one protocol for all of them.

Each module says what it reads:

* :mod:`~handformer.tokenizers.protocol`: the one protocol (``tok(texts)``, ``encode``,
  ``decode``, ``to_str_tokens`` ...) and the methods every tokenizer shares;
* :mod:`~handformer.tokenizers.wordpiece`: BERT's WordPiece (``tokenizer.json`` or
  ``vocab.txt``), :class:`BertTokenizer`;
* :mod:`~handformer.tokenizers.lm`: an LLM's tokenizer (a folder's ``tokenizer.json`` or a
  GGUF file's metadata), :class:`LMTokenizer`, with its chat template;
* :mod:`~handformer.tokenizers.byte_bpe`: GPT-2's byte-level BPE (``tokenizer.json``, or
  ``vocab.json`` + ``merges.txt``), :class:`TextTokenizer`;
* :mod:`~handformer.tokenizers.chars`: a ``handformer train`` run's character vocabulary,
  :class:`CharVocab`;
* :mod:`~handformer.tokenizers.folder` and :mod:`~handformer.tokenizers.gguf_vocab`: reading
  a Hugging Face folder's tokenizer files, and rebuilding a tokenizer from a GGUF file;
* :mod:`~handformer.tokenizers.loading`: which tokenizer a checkpoint folder has;
* :mod:`~handformer.tokenizers.labels`: how tokens are shown (one label per token, whole
  characters for byte-level tokens).

Tokenizers that read files stand on the ``tokenizers`` library (Hugging Face's; this package
shares its name only inside handformer: ``import tokenizers`` still gets the library).
"""

from handformer.tokenizers.byte_bpe import TextTokenizer
from handformer.tokenizers.chars import CharVocab
from handformer.tokenizers.lm import LMTokenizer
from handformer.tokenizers.loading import folder_tokenizer
from handformer.tokenizers.protocol import Tokenizer, TokenizerMethods
from handformer.tokenizers.wordpiece import BertTokenizer

__all__ = [
    "BertTokenizer",
    "CharVocab",
    "LMTokenizer",
    "TextTokenizer",
    "Tokenizer",
    "TokenizerMethods",
    "folder_tokenizer",
]
