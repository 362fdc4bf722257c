"""Atomic, verified training checkpoints.

A checkpoint is a folder ``RUN_DIR/checkpoints/step-00000100/`` holding

* ``model.safetensors`` + ``config.json`` — the model (what ``CausalLM.from_pretrained`` reads);
* ``trainer_state.safetensors`` — optimiser tensors (AdamW moments, step counts) and RNG
  states;
* ``trainer_state.json`` — everything else: step, optimiser hyper-parameters, schedule, data
  position, tokens seen, mixed-precision scaler;
* ``manifest.json`` — size and SHA-256 of each file above, written last.

How it is written: every file goes into a hidden ``.tmp-step-...`` folder and is fsync-ed; the
manifest is added; the folder is fsync-ed and renamed to ``step-...`` (one atomic rename), and
the parent folder is fsync-ed. A process killed at any moment therefore leaves either a
complete checkpoint or a ``.tmp-*`` folder that is never read (and is deleted on resume).
When loading, every file is checked against the manifest before a byte of it is used: a
truncated or altered file, or a checkpoint of another model configuration, raises
:class:`CheckpointError` — training never starts from garbage. Nothing is unpickled.

For tests, ``HANDFORMER_TEST_KILL_DURING_SAVE=STEP`` makes the process SIGKILL itself halfway
through writing ``trainer_state.safetensors`` of the checkpoint of step ``STEP``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor, nn

from handformer.checks import mkstemp_beside
from handformer.weights import CheckpointError, checkpoint_problems, load_safetensors

__all__ = ["CheckpointError", "atomic_write_bytes", "save_checkpoint", "load_checkpoint",
           "list_checkpoints", "latest_checkpoint", "verify_checkpoint", "prune_checkpoints",
           "remove_stale_temporaries", "CHECKPOINTS", "FORMAT"]

CHECKPOINTS = "checkpoints"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})$")
_KILL_ENV = "HANDFORMER_TEST_KILL_DURING_SAVE"


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames inside it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path``: temporary file in the same folder, fsync, rename, fsync dir.

    Returns:
        ``path``.
    """
    path = Path(path)
    tmp = mkstemp_beside(path)  # a missing folder is named, not the temporary file
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _write_file(path: Path, data: bytes, *, kill_midway: bool = False) -> None:
    with open(path, "wb") as f:
        if kill_midway:  # test hook: die with half the bytes on disk
            f.write(data[:len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict]:
    """Split an optimiser state dict into tensors (for safetensors) and JSON."""
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, object]] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{idx}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, object]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
    for idx, values in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(run_dir: Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, state: dict[str, object],
                    rng: dict[str, Tensor]) -> Path:
    """Write the checkpoint of ``step`` atomically (see the module docstring).

    Args:
        run_dir: the run folder.
        step: optimiser steps done.
        model: the (unwrapped) model; it must have ``save_pretrained(dir)``.
        optimizer: its optimiser.
        state: JSON-ready trainer state (step, schedule, data position, ...).
        rng: RNG state tensors by name.

    Returns:
        The checkpoint folder.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = Path(mkstemp_beside(final, folder=True))  # .tmp-step-NNNNNNNN-xxxx
    try:
        model.save_pretrained(tmp)
        for name in ("model.safetensors", "config.json"):
            _fsync_file(tmp / name)
        optim_tensors, optim_meta = _optimizer_tensors(optimizer)
        tensors = {**optim_tensors, **{f"rng.{k}": v.contiguous() for k, v in rng.items()}}
        kill = os.environ.get(_KILL_ENV) == str(step)
        _write_file(tmp / "trainer_state.safetensors", save_safetensors_bytes(tensors),
                    kill_midway=kill)
        meta = {"format": FORMAT, **state, "step": step, "optimizer": optim_meta}
        _write_file(tmp / "trainer_state.json", (json.dumps(meta) + "\n").encode())
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.iterdir())}
        manifest = {"format": FORMAT, "step": step, "files": files}
        _write_file(tmp / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
        fsync_dir(tmp)
        if final.exists():  # an older run's checkpoint of the same step (e.g. re-run)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    return final


def verify_checkpoint(path: Path) -> dict:
    """Check a checkpoint folder against its manifest; return the manifest.

    Raises:
        CheckpointError: for a missing or unreadable manifest, a missing file, or a file whose
            size or SHA-256 differs from the manifest (truncated or corrupt).
    """
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no manifest.json: it is incomplete or "
                              "not a handformer checkpoint") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: manifest.json is corrupt ({exc})") from None
    for required in ("model.safetensors", "config.json", "trainer_state.safetensors",
                     "trainer_state.json"):
        if required not in files:
            raise CheckpointError(f"checkpoint {path}: manifest.json does not list {required}")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = f.stat().st_size
        if size != info.get("bytes"):
            raise CheckpointError(f"checkpoint {path}: {name} has {size} bytes, the manifest "
                                  f"says {info.get('bytes')} (truncated or corrupt); refusing "
                                  "to resume from it")
        if _sha256(f) != info.get("sha256"):
            raise CheckpointError(f"checkpoint {path}: {name} does not match its SHA-256 in "
                                  "the manifest (corrupt); refusing to resume from it")
    return manifest


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    expected_config: dict[str, object]) -> tuple[dict, dict[str, Tensor]]:
    """Verify a checkpoint and load it into ``model`` and ``optimizer``.

    Args:
        path: the checkpoint folder.
        model: the (unwrapped) model, built from ``expected_config``.
        optimizer: its optimiser (same parameter groups).
        expected_config: the model config the run uses (``config.json``'s content).

    Returns:
        ``(trainer_state, rng_tensors)``.

    Raises:
        CheckpointError: for a corrupt checkpoint, another model configuration, missing,
            unexpected or mis-shaped weights, or an optimiser state that does not fit (every
            weight and optimiser problem listed together, by parameter name). Nothing is
            loaded then (the model and optimiser are unchanged).
    """
    path = Path(path)
    verify_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    if config != expected_config:
        diff = sorted(k for k in set(config) | set(expected_config)
                      if config.get(k) != expected_config.get(k))
        raise CheckpointError(
            f"checkpoint {path} is of another model configuration (differs in "
            + ", ".join(f"{k}: {config.get(k)!r} vs {expected_config.get(k)!r}" for k in diff)
            + ")")
    meta = json.loads((path / "trainer_state.json").read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}, this "
                              f"handformer reads format {FORMAT}")
    tensors = load_safetensors_bytes((path / "trainer_state.safetensors").read_bytes())
    optim_state = _optimizer_state(tensors, meta["optimizer"])
    problems = _optimizer_problems(optim_state, optimizer, model)
    problems += checkpoint_problems(model, path / "model.safetensors")
    if problems:  # every problem of the weights and of the optimiser state, in one message
        raise CheckpointError(f"checkpoint {path} does not fit this model; nothing was "
                              "loaded.\n" + "\n".join(problems))
    load_safetensors(model, path / "model.safetensors")
    optimizer.load_state_dict(optim_state)
    rng = {k[len("rng."):]: v for k, v in tensors.items() if k.startswith("rng.")}
    return meta, rng


def _optimizer_problems(optim_state: dict, optimizer: torch.optim.Optimizer,
                        model: nn.Module) -> list[str]:
    """What keeps a saved optimiser state from fitting ``optimizer``, by parameter name."""
    saved = [len(g["params"]) for g in optim_state["param_groups"]]
    current = [len(g["params"]) for g in optimizer.param_groups]
    if saved != current:
        return [f"optimiser state: the checkpoint has parameter groups of sizes {saved}, "
                f"this optimiser {current}"]
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wrong = []
    for idx, st in sorted(optim_state["state"].items()):
        if not 0 <= idx < len(params):
            wrong.append(f"state for parameter {idx}, but the optimiser has {len(params)}")
            continue
        param = params[idx]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st and st[key].shape != param.shape:
                wrong.append(f"{names.get(id(param), f'parameter {idx}')}: {key} is "
                             f"{tuple(st[key].shape)}, the parameter is {tuple(param.shape)}")
    if not wrong:
        return []
    return [f"{len(wrong)} optimiser state mismatches:\n  " + "\n  ".join(wrong)]


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint folders ``(step, path)``, oldest first (``.tmp-*`` skipped)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder of a run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Delete what an interrupted write left behind (``.tmp-*`` folders, ``.*.tmp`` files)."""
    run_dir = Path(run_dir)
    for folder in (run_dir, run_dir / CHECKPOINTS):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".tmp-") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
                p.unlink(missing_ok=True)
