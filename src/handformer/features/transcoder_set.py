"""One transcoder per layer, from one path: what an attribution graph needs.

:func:`load_transcoder_set` reads

- a circuit-tracer ``config.yaml`` (or its folder): :func:`~handformer.features.load_dictionary`
  gives the list;
- a ``handformer train-sae --transcoder --at all`` run folder: ``dictionaries/*/`` holds one
  transcoder per layer;
- a folder whose sub-folders or files each hold one transcoder (any layout
  :func:`~handformer.features.load_dictionary` reads), e.g. ``layer_0/``, ``layer_1/``;
- a single transcoder (its layer alone; the other layers are all error).

Each transcoder's layer comes from its hook names (``blocks.N.…``); a layer given twice, a
sparse autoencoder among them, or one whose hook names no layer is refused, naming the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from handformer.features.dictionary import Transcoder
from handformer.features.files import DictionaryFileError
from handformer.features.store import load_dictionary

__all__ = ["load_transcoder_set", "transcoder_layer"]

_LAYER = re.compile(r"^blocks\.(\d+)\.")
MAX_FILES = 1024  # sub-folders looked at in one folder


def transcoder_layer(tc: Transcoder) -> int | None:
    """The layer a transcoder belongs to, from its output hook (or its input hook) name.

    Args:
        tc: the transcoder.

    Returns:
        ``N`` of ``blocks.N.…``, or None when neither hook name says.
    """
    for name in (getattr(tc, "output_hook_name", None), tc.hook_name):
        m = _LAYER.match(name or "")
        if m:
            return int(m.group(1))
    return None


def _members(folder: Path) -> list[Path]:
    """The entries of ``folder`` that may hold one dictionary each, sorted."""
    runs = folder / "dictionaries"
    base = runs if runs.is_dir() else folder
    found = sorted(p for p in base.iterdir()
                   if p.is_dir() or p.suffix in (".safetensors", ".npz", ".yaml", ".yml"))
    if len(found) > MAX_FILES:
        raise DictionaryFileError(f"{base}: {len(found)} entries, more than {MAX_FILES}; give "
                                  "the folder of one transcoder set")
    return found


def load_transcoder_set(path: str | os.PathLike, *, n_layers: int | None = None
                        ) -> list[Transcoder | None]:
    """One transcoder (or None) per layer from ``path`` (see the module docs for layouts).

    Args:
        path: a circuit-tracer config, a train-sae run folder, a folder of transcoders, or
            one transcoder.
        n_layers: the model's layers (the list's length); None: up to the last layer found.

    Returns:
        A list, index = layer, None where no transcoder was given.

    Raises:
        FileNotFoundError: nothing readable there.
        DictionaryFileError: (a ``ValueError``) a sparse autoencoder, a transcoder without a
            layer in its hook names, a layer twice, a layer past ``n_layers``; or the
            loaders' errors, naming the file.
    """
    path = Path(path)
    by_layer: dict[int, Transcoder] = {}
    try:
        loaded = load_dictionary(path)
    except FileNotFoundError:
        if not path.is_dir():
            raise
        loaded = None
    if isinstance(loaded, list):  # circuit-tracer: index = layer already
        out: list[Transcoder | None] = list(loaded)
        if n_layers is not None and len(out) != n_layers:
            raise DictionaryFileError(f"{path}: {len(out)} transcoders for a model of "
                                      f"{n_layers} layers")
        return out
    entries = [(path, loaded)] if loaded is not None else []
    if loaded is None:
        for member in _members(path):
            try:
                entries.append((member, load_dictionary(member)))
            except FileNotFoundError:
                continue  # a folder of something else (logs, checkpoints)
    if not entries:
        raise FileNotFoundError(f"{path}: no transcoders found (give a circuit-tracer "
                                "config.yaml, a handformer train-sae --transcoder run folder, or "
                                "a folder of one transcoder per layer)")
    for where, d in entries:
        if not isinstance(d, Transcoder):
            raise DictionaryFileError(f"{where}: a {type(d).__name__}, not a transcoder (an "
                                      "attribution graph replaces each MLP by a transcoder)")
        layer = transcoder_layer(d)
        if layer is None:
            raise DictionaryFileError(f"{where}: its hook names ({d.hook_name!r}, "
                                      f"{getattr(d, 'output_hook_name', None)!r}) say no layer "
                                      "(blocks.N....); save it with hook_name set")
        if layer in by_layer:
            raise DictionaryFileError(f"{where}: a second transcoder for layer {layer}")
        if n_layers is not None and layer >= n_layers:
            raise DictionaryFileError(f"{where}: a transcoder of layer {layer}, the model has "
                                      f"{n_layers} layers (0..{n_layers - 1})")
        by_layer[layer] = d
    count = n_layers if n_layers is not None else max(by_layer) + 1
    return [by_layer.get(i) for i in range(count)]
