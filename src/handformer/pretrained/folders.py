"""Checkpoint folders in Hugging Face's layout: find the weights file, read ``config.json``.

Shared by every pretrained loader (``load_bert``, ``BertModel.from_pretrained``,
``load_gpt2``). A folder holds ``config.json`` and ``model.safetensors``; a folder whose
weights are only a pickle file (``pytorch_model.bin``) is refused with the reason and the
conversion to safetensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from handformer.weights import (
    CheckpointError,
    check_not_pickle,
    pickle_files,
    pickle_refusal,
)

__all__ = ["resolve_checkpoint_dir", "read_config_json", "WEIGHTS_NAME", "CONFIG_NAME"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def resolve_checkpoint_dir(path: str | os.PathLike) -> tuple[Path, Path]:
    """Return ``(folder, weights file)`` for a checkpoint folder or its ``.safetensors`` file.

    Raises:
        FileNotFoundError: for a missing folder, or a folder without weights.
        CheckpointError: for a pickle file, a folder whose weights are only a pickle file
            (``pytorch_model.bin``: the message says how to convert it), or a sharded
            checkpoint.
    """
    folder = Path(path)
    if folder.is_file():
        check_not_pickle(folder)
        return folder.parent, folder
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {folder}")
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        pickles = pickle_files(folder)
        if pickles:
            raise pickle_refusal(pickles[0], found_instead_of=WEIGHTS_NAME)
        if (folder / f"{WEIGHTS_NAME}.index.json").is_file():
            raise CheckpointError(f"{folder}: sharded checkpoints ({WEIGHTS_NAME}.index.json)"
                                  " are not supported; save the model as one file")
        raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME}")
    return folder, weights


def read_config_json(folder: Path) -> dict:
    """The folder's ``config.json`` as a dict.

    Raises:
        FileNotFoundError: if there is none.
        ValueError: if it is not a JSON object.
    """
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object (found {type(data).__name__})")
    return data
