"""Checkpoint folders in Hugging Face's layout: find the weights file, read ``config.json``.

Shared by every pretrained loader (``load_bert``, ``BertModel.from_pretrained``,
``load_gpt2``). A folder holds ``config.json`` and ``model.safetensors``; a folder whose
weights are only a pickle file (``pytorch_model.bin``) is refused with the reason and the
conversion to safetensors.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from handformer.weights import (
    CheckpointError,
    check_not_pickle,
    pickle_files,
    pickle_refusal,
)

__all__ = ["resolve_checkpoint_dir", "read_config_json", "check_device", "hub_hint",
           "WEIGHTS_NAME", "CONFIG_NAME"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "gpt2", "org/name"


def hub_hint(path: str | os.PathLike) -> str:
    """For a missing ``path`` that could be a model hub name: the sentence that says
    handformer reads local folders only, and the one line that saves a hub model as one."""
    text = os.fspath(path)
    if not isinstance(text, str) or not _HUB_ID.fullmatch(text) or text.endswith(
            (".safetensors", ".gguf", ".json")):
        return ""
    return (f"; handformer reads local folders and files only (no model hub). If {text!r} "
            "is a model hub name, save it as a folder once (where the hub can be reached): "
            "python -c \"from transformers import AutoModel, AutoTokenizer; "
            f"AutoModel.from_pretrained('{text}').save_pretrained('{text}'); "
            f"AutoTokenizer.from_pretrained('{text}').save_pretrained('{text}')\"")


def check_device(device: object) -> torch.device:
    """The ``torch.device`` for a loader's ``device`` argument.

    Raises:
        TypeError: for something that is not a string or a ``torch.device``.
        ValueError: for a name torch does not know, or CUDA (or MPS) where there is none.
    """
    if isinstance(device, torch.device):
        result = device
    elif isinstance(device, str):
        try:
            result = torch.device(device)
        except (RuntimeError, ValueError):
            raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or "
                             f"'cuda:0', got {device!r}") from None
    else:
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', or a "
                        f"torch.device, got {type(device).__name__} {device!r}")
    if result.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA GPU is available to this PyTorch "
                         f"({torch.__version__}); use device='cpu'")
    if result.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here; use device='cpu'")
    return result


def resolve_checkpoint_dir(path: str | os.PathLike) -> tuple[Path, Path]:
    """Return ``(folder, weights file)`` for a checkpoint folder or its ``.safetensors`` file.

    Raises:
        TypeError: for a ``path`` that is not a ``str`` or ``os.PathLike``.
        FileNotFoundError: for a missing folder (for a name like ``"gpt2"`` the message says
            that there is no model hub, and how to save a hub model as a folder), or a folder
            without weights.
        CheckpointError: for a pickle file, a folder whose weights are only a pickle file
            (``pytorch_model.bin``: the message says how to convert it), or a sharded
            checkpoint.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a checkpoint folder or file (a str or os.PathLike), "
                        f"got {type(path).__name__} {path!r}")
    folder = Path(path)
    if folder.is_file():
        check_not_pickle(folder)
        return folder.parent, folder
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {folder}{hub_hint(path)}")
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
