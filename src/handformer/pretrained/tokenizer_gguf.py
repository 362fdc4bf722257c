"""Moved to :mod:`handformer.tokenizers.gguf_vocab`; this path works until the next release, with a
``DeprecationWarning``."""

from handformer.pretrained._moved import forward
from handformer.tokenizers import gguf_vocab as _new

__all__, __getattr__ = forward(__name__, _new)
