"""A checkpoint's weights, one safetensors file or a sharded checkpoint's shards, read
lazily: only the headers when opened, then one tensor at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from torch import Tensor

from handformer.pretrained.folders import WEIGHTS_NAME
from handformer.weights import (
    CheckpointError,
    _read_tensors,
    check_not_pickle,
    pickle_files,
    pickle_refusal,
    read_safetensors_header,
)

__all__ = ["SafetensorsState", "open_weights", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"


class SafetensorsState(Mapping):
    """A checkpoint's tensors by name, read from one or more safetensors files on access.

    Only the headers are read on creation (each file validated: a truncated or corrupt one
    raises there); ``state[key]`` reads that one tensor into fresh memory, so a loader that
    installs each tensor before asking for the next holds one model's worth at the peak.

    Args:
        files: the safetensors files (one, or a sharded checkpoint's shards).

    Attributes:
        header: ``{key: {"dtype", "shape", ...}}`` over every file.

    Raises:
        FileNotFoundError, CheckpointError: as
            :func:`~handformer.weights.read_safetensors_header`; CheckpointError also for a
            tensor held by two shards.
    """

    def __init__(self, files: list[Path]) -> None:
        self.files = [Path(p) for p in files]
        self.header: dict[str, dict] = {}
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for path in self.files:
            header, start = read_safetensors_header(path)
            for key, info in header.items():
                if key in self._where:
                    raise CheckpointError(f"{path}: tensor {key} is also in "
                                          f"{self._where[key][0].name}; each tensor belongs "
                                          "in one shard")
                self._where[key] = (path, header, start)
                self.header[key] = info

    def __getitem__(self, key: str) -> Tensor:
        path, header, start = self._where[key]
        return _read_tensors(path, header, start, [key])[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.header)

    def __len__(self) -> int:
        return len(self.header)


def open_weights(folder: Path) -> SafetensorsState:
    """The weights of a checkpoint folder: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` lists.

    Raises:
        FileNotFoundError: for a folder without weights, or a shard the index names that is
            not there.
        CheckpointError: for pickle-only folders (with the conversion), a malformed index,
            a shard name that leaves the folder, and an index that disagrees with its shards
            (every such key named).
    """
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return SafetensorsState([single])
    index = folder / INDEX_NAME
    if not index.is_file():
        pickles = pickle_files(folder)
        if pickles:
            raise pickle_refusal(pickles[0], found_instead_of=WEIGHTS_NAME)
        raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME} (nor a sharded "
                                f"{INDEX_NAME})")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a "
                              f"'weight_map'): {exc}") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    shards = sorted(set(weight_map.values()))
    for name in shards:
        if Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{index}: shard {name!r} is not a file name in {folder}")
        check_not_pickle(folder / name)
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{index} lists shard {name}, which is not in {folder}")
    state = SafetensorsState([folder / name for name in shards])
    wrong = [f"{key} (index: {shard}, found in "
             f"{state._where[key][0].name if key in state._where else 'no shard'})"
             for key, shard in sorted(weight_map.items())
             if key not in state._where or state._where[key][0].name != shard]
    unlisted = sorted(set(state.header) - set(weight_map))
    if wrong or unlisted:
        sections = [f"{len(items)} {title}:\n  " + "\n  ".join(items) for title, items in (
            ("keys not where the index says", wrong),
            ("keys in the shards but not in the index", unlisted)) if items]
        raise CheckpointError(f"{index} does not match its shards; nothing was loaded.\n"
                              + "\n".join(sections))
    return state
