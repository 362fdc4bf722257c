"""Moved to :mod:`handformer.chat.sandbox`; this path works until the next release, with a
``DeprecationWarning``."""

from handformer.chat import sandbox as _new
from handformer.pretrained._moved import forward

__all__, __getattr__ = forward(__name__, _new)
