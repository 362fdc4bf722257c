"""Strict, all-or-nothing safetensors loading into an existing module.

One function, :func:`load_safetensors`, shared by every checkpoint loader (BERT, GPT-2,
``CausalLM.from_pretrained``, training checkpoints), and its counterpart for writing,
:func:`save_safetensors` (atomic: temporary file, fsync, rename). It depends only on torch and
safetensors, so it sits below the models in the layering.
A loader supplies a *key map*: a function from a checkpoint key to the model's state-dict key
(or ``None`` for a key it deliberately skips, such as a task head), and where the names differ
its inverse (a ``file_key(model_key)`` method, or the ``file_keys`` argument), so that keys
missing from the file are reported under the names the file should hold them by. Then:

1. the path is checked: pickle checkpoints (``.bin``, ``.pt``, ...) are refused, never opened;
2. the safetensors header is validated (a truncated or corrupt file raises here);
3. every key is checked: missing, unexpected, duplicated and mis-shaped keys are collected and
   reported together in one :class:`CheckpointError`, in the checkpoint's key names (with the
   model's name beside it where the two differ) and with both shapes;
4. every tensor is read into fresh memory with plain file reads (no memory map, so the peak
   memory is about one copy of the weights);
5. only then are the parameters replaced or copied. A failure in steps 1-4 leaves the model
   exactly as it was.

Tied parameters (one tensor under two names, e.g. GPT-2's ``lm_head.weight`` and
``wte.weight``) count as one entry: the checkpoint must hold it under one of the names.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from handformer.checks import mkstemp_beside
from handformer.legacy_names import legacy_key_map

__all__ = ["CheckpointError", "LoadReport", "load_safetensors", "checkpoint_problems",
           "read_safetensors_header", "save_safetensors", "write_atomically", "pickle_refusal",
           "pickle_files", "PICKLE_SUFFIXES"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}

DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

KeyMap = Callable[[str], object] | Mapping[str, object]
FileKeys = Callable[[str], str] | Mapping[str, str]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: wrong format, corrupt, or not matching the model."""


@dataclass
class LoadReport:
    """What :func:`load_safetensors` did.

    Attributes:
        loaded: ``(checkpoint key, model key)`` pairs that were loaded.
        skipped: checkpoint keys the key map deliberately skipped (mapped to None).
    """

    loaded: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def pickle_refusal(path: Path, *, found_instead_of: str | None = None) -> CheckpointError:
    """The error for a pickle checkpoint: why it is refused and how to convert it.

    Args:
        path: the pickle file (``pytorch_model.bin``, ``model.pt``, ...).
        found_instead_of: the safetensors file that was looked for, when the pickle file was
            found in its place (a folder holding only ``pytorch_model.bin``).
    """
    folder = path.parent
    found = (f"{folder}: found {path.name} but no {found_instead_of}. {path.name}"
             if found_instead_of else str(path))
    return CheckpointError(
        f"{found} is a pickle checkpoint ({path.suffix}), refused on purpose: "
        "unpickling can run arbitrary code, so handformer never opens pickle files and reads "
        "only safetensors. Convert it once, where you trust the file: with transformers, "
        f"`from transformers import AutoModel; "
        f"AutoModel.from_pretrained({str(folder)!r}).save_pretrained({str(folder)!r}, "
        "safe_serialization=True)` (AutoModelForCausalLM for GPT-2); for a plain state dict "
        "without tied tensors, `import torch, safetensors.torch as st; "
        f"st.save_file(torch.load({str(path)!r}, weights_only=True), "
        f"{str(folder / 'model.safetensors')!r})`"
    )


def check_not_pickle(path: Path) -> None:
    """Refuse pickle-based checkpoints by suffix, before anything opens them.

    Raises:
        CheckpointError: if ``path`` ends in a pickle suffix such as ``.bin`` or ``.pt``.
    """
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise pickle_refusal(path)


def pickle_files(folder: Path) -> list[Path]:
    """The pickle checkpoints in ``folder``, model weights (``pytorch_model.bin``) first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES]
    return sorted(found, key=lambda p: ("model" not in p.name, p.name))


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """Validate a safetensors file and return its tensor table and data offset.

    The file is first opened with the ``safetensors`` library, which checks the header and
    that the data section covers every tensor (a truncated file fails here); the header is then
    read to get each tensor's byte range.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        ``(tensors, data_start)``: ``tensors`` maps each key to ``{"dtype", "shape",
        "data_offsets"}``; byte offsets are relative to ``data_start``.

    Raises:
        FileNotFoundError: if the file does not exist.
        CheckpointError: for pickle suffixes (also when the file is missing and its folder
            holds a pickle checkpoint instead), and for truncated or corrupt files.
    """
    path = Path(path)
    check_not_pickle(path)
    if not path.is_file():
        pickles = pickle_files(path.parent)
        if pickles:
            raise pickle_refusal(pickles[0], found_instead_of=path.name)
        raise FileNotFoundError(f"no safetensors file at {path}")
    try:
        with safe_open(str(path), framework="pt"):
            pass
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (SafetensorError, ValueError, struct.error) as exc:
        size = path.stat().st_size
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({size} bytes); it is truncated or "
            f"corrupt ({exc}). Download or save it again"
        ) from exc
    header.pop("__metadata__", None)
    return header, 8 + n


Transform = Callable[[Tensor], Tensor]
Target = tuple[str, "Transform | None"]


def _resolve(key_map: KeyMap | None, key: str) -> list[Target] | None:
    """The key map's answer as a list of ``(model key, transform or None)``; None = skip."""
    if key_map is None:
        result: object = key
    elif isinstance(key_map, Mapping):
        result = key_map.get(key, key)
    else:
        result = key_map(key)
    if result is None:
        return None
    if isinstance(result, str):
        return [(result, None)]
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str):
        return [result]  # type: ignore[list-item]
    return [(t, None) if isinstance(t, str) else tuple(t) for t in result]  # type: ignore[misc]


def _model_entries(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """State entries by name, and each name's group of aliases (tied tensors)."""
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    aliases = {name: groups[id(t)] for name, t in state.items()}
    return state, aliases


def _fmt_shape(shape: object) -> str:
    return str(tuple(shape))  # type: ignore[arg-type]


def _file_key_function(key_map: KeyMap | None, file_keys: FileKeys | None
                       ) -> Callable[[str], str]:
    """Model key -> the checkpoint key expected for it (the inverse of the key map)."""
    if file_keys is None:
        file_keys = getattr(key_map, "file_key", None)
    if file_keys is None and isinstance(key_map, Mapping):
        file_keys = {v: k for k, v in key_map.items() if isinstance(v, str)}
    if file_keys is None:
        return lambda key: key
    if isinstance(file_keys, Mapping):
        mapping = file_keys
        return lambda key: mapping.get(key, key)
    return file_keys


def _plan(model: nn.Module, header: dict[str, dict], key_map: KeyMap | None,
          file_keys: FileKeys | None
          ) -> tuple[list[tuple[str, str, Transform | None]], list[str], list[str]]:
    """Match checkpoint keys to model keys: ``(plan, skipped, problems)``.

    ``problems`` holds one titled section per kind of problem (empty when the file fits).
    Checkpoint keys come first in every line, the model's name beside it where it differs.
    """
    state, aliases = _model_entries(model)
    if key_map is None:  # handformer's own files: today's names, or the old ones
        key_map = legacy_key_map(model) or None
        file_keys = file_keys if file_keys is not None else {}  # report today's names
    file_key = _file_key_function(key_map, file_keys)
    plan: list[tuple[str, str, Transform | None]] = []
    skipped: list[str] = []
    covered: dict[str, str] = {}  # first alias of a group -> checkpoint key
    unexpected, mis_shaped, bad_dtype, duplicated = [], [], [], []
    for ckpt_key in sorted(header):
        info = header[ckpt_key]
        targets = _resolve(key_map, ckpt_key)
        if targets is None:
            skipped.append(ckpt_key)
            continue
        dtype = DTYPES.get(info["dtype"])
        for target, transform in targets:
            if target not in state:
                unexpected.append(f"{ckpt_key} {_fmt_shape(info['shape'])}"
                                  + (f" (mapped to {target})" if target != ckpt_key else ""))
                continue
            group = aliases[target][0]
            if group in covered:
                duplicated.append(f"{ckpt_key} and {covered[group]} both load {target}")
                continue
            covered[group] = ckpt_key
            expected = state[target]
            if dtype is None or dtype.is_floating_point != expected.dtype.is_floating_point:
                bad_dtype.append(f"{ckpt_key}: dtype {info['dtype']} cannot load into "
                                 f"{target} ({expected.dtype})")
                continue
            shape = _shape_after(transform, info["shape"], dtype)
            if shape != tuple(expected.shape):
                via = "" if transform is None else " after the key map's transform"
                mis_shaped.append(f"{ckpt_key}: model {target} expects "
                                  f"{_fmt_shape(expected.shape)}, found "
                                  f"{shape if isinstance(shape, str) else _fmt_shape(shape)}{via}")
                continue
            plan.append((ckpt_key, target, transform))
    missing = []
    for names in {tuple(v): None for v in aliases.values()}:  # each tied group once, in order
        if names[0] in covered:
            continue
        name = file_key(names[0])
        missing.append(f"{name} {_fmt_shape(state[names[0]].shape)}"
                       + (f" (model: {names[0]})" if name != names[0] else ""))
    problems = []
    for title, items in (("missing keys (in the model, not in the file)", sorted(missing)),
                         ("unexpected keys (in the file, not in the model)", unexpected),
                         ("mis-shaped keys", mis_shaped), ("unsupported dtypes", bad_dtype),
                         ("duplicated keys", duplicated)):
        if items:
            problems.append(f"{len(items)} {title}:\n  " + "\n  ".join(items))
    return plan, skipped, problems


def _mismatch_error(path: Path, model: nn.Module, problems: list[str]) -> CheckpointError:
    return CheckpointError(f"{path}: the checkpoint does not match {type(model).__name__}; "
                           "nothing was loaded.\n" + "\n".join(problems))


def checkpoint_problems(model: nn.Module, path: str | os.PathLike,
                        key_map: KeyMap | None = None, *,
                        file_keys: FileKeys | None = None) -> list[str]:
    """Everything that keeps a checkpoint from loading into ``model``, without loading it.

    Takes the same arguments as :func:`load_safetensors` and reads only the file's header.
    Use it to report a checkpoint's problems together with others (e.g. a training
    checkpoint's optimiser state) before anything is loaded.

    Returns:
        One titled section per kind of problem (missing, unexpected, mis-shaped, unsupported
        dtypes, duplicated), each listing every key; empty when the file fits the model.

    Raises:
        FileNotFoundError, CheckpointError: as :func:`read_safetensors_header`.
    """
    header, _ = read_safetensors_header(path)
    return _plan(model, header, key_map, file_keys)[2]


def _shape_after(transform: Transform | None, shape: list[int], dtype: torch.dtype
                 ) -> tuple[int, ...] | str:
    """The shape a transform produces, found on a meta tensor (no data is read)."""
    if transform is None:
        return tuple(shape)
    try:
        return tuple(transform(torch.empty(shape, dtype=dtype, device="meta")).shape)
    except Exception as exc:  # noqa: BLE001 - reported with the other problems
        return f"an error in the transform: {exc}"


def _read_tensors(path: Path, header: dict[str, dict], data_start: int,
                  keys: list[str]) -> dict[str, Tensor]:
    """Read ``keys`` into fresh CPU tensors with ordinary file reads (no memory map)."""
    out: dict[str, Tensor] = {}
    with open(path, "rb") as f:
        for key in sorted(keys, key=lambda k: header[k]["data_offsets"][0]):
            info = header[key]
            begin, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=DTYPES[info["dtype"]])
            # the tensor's memory as flat bytes (numel * itemsize,), filled in place
            buf = t.view(-1).view(torch.uint8).numpy() if t.numel() else None
            f.seek(data_start + begin)
            if buf is not None and f.readinto(memoryview(buf)) != end - begin:
                raise CheckpointError(f"{path}: file ended while reading {key}; it is "
                                      "truncated (or changed while loading). Nothing was loaded")
            out[key] = t
    return out


def load_safetensors(model: nn.Module, path: str | os.PathLike,
                     key_map: KeyMap | None = None, *, file_keys: FileKeys | None = None,
                     assign: bool = False) -> LoadReport:
    """Load a safetensors checkpoint into ``model``, strictly and all-or-nothing.

    Args:
        model: the module to load into. Every parameter and persistent buffer must be
            provided by the file (tied tensors once).
        path: a ``.safetensors`` file. Pickle checkpoints are refused.
        key_map: checkpoint key -> model state-dict key, as a function or a mapping (keys
            absent from a mapping keep their name); ``None`` as the result skips the key on
            purpose (e.g. a task head or a constant buffer). A result may also be a
            ``(model key, transform)`` pair or a list of such pairs (and plain keys): the
            transform maps the stored tensor to the parameter's value, e.g. a transpose, or
            one third of a fused query/key/value matrix; shapes are checked by running it on
            a meta tensor before anything is read. Default: names unchanged, except the
            module names before "one name per part" (``layers.0.self_attn`` ->
            ``blocks.0.attn``, :func:`~handformer.legacy_names.legacy_key_map`). A key map
            object may define ``file_key(model_key)``, its inverse (see ``file_keys``).
        file_keys: model key -> the checkpoint key it is loaded from, as a function or a
            mapping: the names under which missing keys are reported (the model's name is
            given beside them). Default: the key map's ``file_key`` method if it has one, the
            inverted mapping for a mapping key map, else the model's names.
        assign: replace the parameters by the loaded tensors (cast to each parameter's dtype
            and device) instead of copying into them. Use it for models built on the
            ``meta`` device: no memory is spent on throw-away initial weights.

    Returns:
        A :class:`LoadReport` of loaded and skipped keys.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        CheckpointError: for pickle files, truncated or corrupt files, and for missing,
            unexpected, duplicated, mis-shaped or wrongly typed keys (all listed in one
            message, in the checkpoint's key names, grouped by kind, with both shapes of a
            mis-shaped key). On any error the model is left unchanged.
    """
    path = Path(path)
    header, data_start = read_safetensors_header(path)
    plan, skipped, problems = _plan(model, header, key_map, file_keys)
    if problems:
        raise _mismatch_error(path, model, problems)
    tensors = _read_tensors(path, header, data_start, sorted({k for k, _, _ in plan}))
    values = {}
    for ckpt_key, target, transform in plan:  # every value is ready before any is installed
        value = tensors[ckpt_key]
        values[target] = value if transform is None else transform(value).contiguous()
    del tensors
    _, aliases = _model_entries(model)
    with torch.no_grad():
        for _, target, _ in plan:
            _install(model, aliases[target], values.pop(target), assign=assign)
    return LoadReport(loaded=[(k, t) for k, t, _ in plan], skipped=skipped)


def _install(model: nn.Module, names: list[str], value: Tensor, *, assign: bool) -> None:
    """Copy ``value`` into the tensor called ``names[0]``, or assign it under every alias."""
    owner, _, leaf = names[0].rpartition(".")
    module = model.get_submodule(owner)
    current = module._parameters.get(leaf)
    is_param = current is not None
    if current is None:
        current = module._buffers[leaf]
    device = current.device if current.device.type != "meta" else torch.device("cpu")
    value = value.to(device=device, dtype=current.dtype)
    if not assign:
        current.copy_(value)
        return
    new: Tensor = nn.Parameter(value, requires_grad=current.requires_grad) if is_param else value
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if is_param:
            module._parameters[leaf] = new  # type: ignore[assignment]
        else:
            module._buffers[leaf] = new


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, rename it over ``path``.

    A crash at any moment leaves either the old file or the new one, never half of one.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    tmp = mkstemp_beside(path)  # a missing folder is named, not the temporary file
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable (where directories can be fsync-ed)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def save_safetensors(tensors: Mapping[str, Tensor], path: str | os.PathLike) -> Path:
    """Write ``tensors`` (moved to the CPU, made contiguous) to a safetensors file atomically.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return write_atomically(path, lambda tmp: save_file(state, str(tmp),
                                                        metadata={"format": "pt"}))
