"""Moved to :mod:`handformer.chat.template`; this path works until the next release, with a
``DeprecationWarning``."""

from handformer.chat import template as _new
from handformer.pretrained._moved import forward

__all__, __getattr__ = forward(__name__, _new)
