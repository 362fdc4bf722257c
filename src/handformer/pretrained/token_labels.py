"""Moved to :mod:`handformer.tokenizers.labels`; this path works until the next release, with a
``DeprecationWarning``."""

from handformer.pretrained._moved import forward
from handformer.tokenizers import labels as _new

__all__, __getattr__ = forward(__name__, _new)
