"""The old import paths of modules that moved out of :mod:`handformer.pretrained`.

The tokenizers now live in :mod:`handformer.tokenizers` and the chat code in
:mod:`handformer.chat`. Each old path is a small module that imports its new home, warns once
(``DeprecationWarning``) and hands out the new module's objects, the same objects, so
``isinstance`` checks and monkeypatching keep working. The old paths go in the next release.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType

__all__ = ["MOVED", "forward"]

MOVED: dict[str, str] = {  # old path -> new path
    "handformer.pretrained.protocol": "handformer.tokenizers.protocol",
    "handformer.pretrained.tokenizer": "handformer.tokenizers.wordpiece",
    "handformer.pretrained.text_tokenizer": "handformer.tokenizers.byte_bpe",
    "handformer.pretrained.lm_tokenizer": "handformer.tokenizers.lm",
    "handformer.pretrained.tokenizer_folder": "handformer.tokenizers.folder",
    "handformer.pretrained.tokenizer_gguf": "handformer.tokenizers.gguf_vocab",
    "handformer.pretrained.token_labels": "handformer.tokenizers.labels",
    "handformer.pretrained.chat": "handformer.chat.session",
    "handformer.pretrained.chat_template": "handformer.chat.template",
    "handformer.pretrained.template_sandbox": "handformer.chat.sandbox",
}


def forward(old: str, new: ModuleType) -> tuple[list[str], Callable[[str], object]]:
    """Warn that ``old`` moved to ``new``, and make ``old`` hand out ``new``'s names.

    Args:
        old: the old module's name (its ``__name__``).
        new: the module it moved to.

    Returns:
        ``(__all__, __getattr__)`` for the old module: ``new``'s public names, and a module
        ``__getattr__`` (PEP 562) that returns ``new``'s object of any name.
    """
    warnings.warn(f"{old} moved to {new.__name__}: import from there (the old path goes in "
                  "the next release)", DeprecationWarning, stacklevel=3)

    def __getattr__(name: str) -> object:
        return getattr(new, name)

    return list(getattr(new, "__all__", ())), __getattr__
