"""Moved to :mod:`handformer.tokenizers.byte_bpe`; this path works until the next release, with a
``DeprecationWarning``."""

from handformer.pretrained._moved import forward
from handformer.tokenizers import byte_bpe as _new

__all__, __getattr__ = forward(__name__, _new)
