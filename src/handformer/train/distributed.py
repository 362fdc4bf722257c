"""Distributed plumbing for ``torchrun``: process group, device, DDP, small collectives.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous variables; when
``WORLD_SIZE > 1`` :func:`setup` joins the process group (``nccl`` when the ranks have CUDA
devices, ``gloo`` otherwise) and every collective below runs over it. Without ``torchrun``
everything degrades to a single process and the collectives are no-ops.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistInfo", "setup", "teardown", "wrap", "unwrap", "all_reduce_sum", "any_flag",
           "barrier"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits.

    Attributes:
        rank: global rank (0 writes logs and checkpoints).
        world_size: number of processes.
        local_rank: rank on this node (picks the GPU).
        device: the device this rank trains on.
        backend: ``"gloo"``, ``"nccl"`` or None (single process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def setup(device: str = "auto") -> DistInfo:
    """Join the ``torchrun`` process group if there is one, and pick the device.

    Args:
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"`` or ``"cuda"``.

    Returns:
        A :class:`DistInfo`.

    Raises:
        ValueError: for an unknown device, or ``"cuda"`` without a GPU.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use --device cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        dev = torch.device("cpu")
    if world <= 1:
        return DistInfo(device=dev)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=dev if use_cuda else None)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=local_rank, device=dev, backend=backend)


def teardown(info: DistInfo) -> None:
    """Leave the process group (if this process joined one).

    On the way out of a run that finished (no exception in flight: this is called from a
    ``finally``), every rank first waits for the others: a rank that destroys its group while
    another still talks to it can abort in gloo's threads ("terminate called without an active
    exception", seen once under load). A rank leaving on an error does not wait: the others
    may never come.
    """
    if info.enabled and dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, info: DistInfo) -> nn.Module:
    """``DistributedDataParallel(model)`` in a distributed run, else ``model`` itself."""
    if not info.enabled:
        return model
    ids = [info.device.index] if info.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or ``model``)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64)."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def any_flag(flag: bool, info: DistInfo) -> bool:
    """True on every rank if ``flag`` is True on any rank (to stop all ranks together)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def barrier(info: DistInfo) -> None:
    """Wait for every rank (no-op in a single process)."""
    if info.enabled:
        dist.barrier()
