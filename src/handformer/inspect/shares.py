"""Sweeps over many prompts: each process of a ``torchrun`` job takes a share, results summed.

Under ``torchrun`` (``torch.distributed`` initialised, e.g. ``init_process_group("gloo")``)
prompt ``i`` belongs to rank ``i % world_size``; every rank sums what it measured over its own
prompts and :func:`reduce_sum` adds the ranks' sums (float64, so the total equals one process's
up to rounding). Without a process group everything is one process's share.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import Tensor
from tqdm.auto import tqdm

from handformer.distributed import tensor_parallel_size

__all__ = ["rank_and_world", "my_share", "reduce_sum", "progress_bar"]

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the process group, ``(0, 1)`` without one.

    Under tensor parallel (:func:`handformer.distributed.parallelize`) the ranks that share
    one model count as one: ``(rank // tp, world_size // tp)``, so they run the same prompts.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        tp = tensor_parallel_size()
        return dist.get_rank() // tp, dist.get_world_size() // tp
    return 0, 1


def my_share(items: Sequence[T]) -> list[tuple[int, T]]:
    """``(index, item)`` of the items this rank measures: index ``% world_size == rank``."""
    rank, world = rank_and_world()
    return [(i, item) for i, item in enumerate(items) if i % world == rank]


def reduce_sum(total: Tensor) -> Tensor:
    """Sum ``total`` over the ranks (float64; unchanged without a process group)."""
    rank, world = rank_and_world()
    total = total.to(torch.float64)
    if world == 1:
        return total
    dist = torch.distributed
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    buffer = total.to(device).contiguous()
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    return buffer.to(total.device) / tensor_parallel_size()  # each model's ranks counted once


def progress_bar(total: int, desc: str, show: bool | None) -> tqdm:
    """A progress bar over ``total`` steps: by default on a terminal, long runs, rank 0 only."""
    rank, _ = rank_and_world()
    if show is None:
        show = total > 1 and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, disable=not show or rank != 0)
