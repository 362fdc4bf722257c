"""The communication of tensor parallel: gathering a sharded hook point, summing row-parallel
outputs, and agreeing that every rank loaded its part.

Each is one collective over the mesh's process group (gloo on CPU, NCCL on GPUs); every rank
must make the same calls in the same order (they run the same program on the same inputs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from handformer.weights import CheckpointError

__all__ = ["IndexShard", "sum_output", "agree", "no_backward"]


class IndexShard:
    """One hook point's sharding: local slot ``j`` along ``dim`` is global index ``index[j]``.

    Implements :class:`handformer.hooks.Shard`. ``every_index[r]`` is rank ``r``'s ``index``
    (a replicated key/value head appears on several ranks; the gathered tensor takes its
    first copy).

    Args:
        dim: the sharded dimension (negative counts from the end).
        every_index: each rank's global indices, in rank order.
        rank: this rank.
        group: the process group of the mesh.
    """

    def __init__(self, dim: int, every_index: list[list[int]], rank: int,
                 group: dist.ProcessGroup) -> None:
        self.dim, self.group = dim, group
        self.counts = [len(ix) for ix in every_index]
        self.index = torch.tensor(every_index[rank], dtype=torch.long)
        flat = [g for ix in every_index for g in ix]
        size = max(flat) + 1
        first: dict[int, int] = {}
        for position, g in enumerate(flat):  # a copy on a later rank: its first one counts
            first.setdefault(g, position)
        if len(first) != size:
            raise ValueError(f"the ranks' indices {every_index} leave out some of 0..{size - 1}")
        self.order = torch.tensor([first[g] for g in range(size)], dtype=torch.long)

    def gather(self, x: Tensor) -> Tensor:
        """This rank's ``(..., n_local, ...)`` -> the full ``(..., n, ...)`` (all ranks call)."""
        no_backward(x)
        dim = self.dim % x.dim()
        part = x.movedim(dim, 0).contiguous()  # (n_local, ...)
        longest = max(self.counts)
        if part.shape[0] < longest:  # all_gather needs one shape: pad, then drop the padding
            pad = part.new_zeros((longest - part.shape[0], *part.shape[1:]))
            part = torch.cat([part, pad])  # (longest, ...)
        pieces = [torch.empty_like(part) for _ in self.counts]
        dist.all_gather(pieces, part, group=self.group)
        slots = torch.cat([p[:c] for p, c in zip(pieces, self.counts, strict=True)])  # (sum, ...)
        full = slots.index_select(0, self.order.to(slots.device))  # (n, ...)
        return full.movedim(0, dim)

    def local(self, x: Tensor) -> Tensor:
        """The full tensor -> this rank's slots (a replacement a hook returned)."""
        return x.index_select(self.dim % x.dim(), self.index.to(x.device))


def no_backward(x: Tensor) -> None:
    """Refuse a tensor autograd follows: the collectives here have no backward.

    Raises:
        ValueError: when ``x`` requires grad (``attribution_patching``, training).
    """
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("a tensor-parallel model runs forward passes only: its collectives "
                         "have no backward (attribution_patching and training need one "
                         "process, or data parallel: handformer.train.distributed)")


def sum_output(group: dist.ProcessGroup, weights: IndexShard | None = None
               ) -> Callable[[nn.Module, tuple, object], object]:
    """A forward hook that adds the ranks' partial outputs (a row-parallel layer's sum over
    its input features): the module's output, or the first of ``(out, weights)``, whose
    per-head ``weights`` (when not None) are gathered by ``weights``."""

    def hook(module: nn.Module, args: tuple, output: object) -> object:
        no_backward(output[0] if isinstance(output, tuple) else output)  # type: ignore[index]
        if isinstance(output, tuple):
            out, attn = output
            dist.all_reduce(out, group=group)  # (B, L, E), in place
            if attn is not None and weights is not None:
                attn = weights.gather(attn)  # (B, H, L_q, L_k)
            return out, attn
        dist.all_reduce(output, group=group)  # type: ignore[arg-type]
        return output

    return hook


def agree(error: BaseException | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank says whether it succeeded; if one failed, every rank raises the same one
    line naming the first failed rank (so none waits for a partner that has gone).

    Args:
        error: what this rank raised (None: it succeeded).
        group: the process group.
        what: what the ranks were doing, for the message ("load its part of model.gguf").

    Raises:
        CheckpointError: on every rank, if any rank failed.
    """
    mine = None if error is None else f"{type(error).__name__}: {error}".splitlines()[0]
    said: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, mine, group=group)
    failed = [(r, m) for r, m in enumerate(said) if m is not None]
    if failed:
        rank, message = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise CheckpointError(f"rank {rank}{others} could not {what}: {message}") from error
