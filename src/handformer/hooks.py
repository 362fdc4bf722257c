"""Hook points: named pass-throughs inside every module, that a hook may read or replace.

Every model's forward passes its intermediate tensors through :class:`HookPoint` modules
(``self.hook_q(q)``, ``self.hook_resid_post(x)``, ...). With no hook listening a hook point
returns its input unchanged, at the cost of one context-variable lookup. Hooks are
registered for the length of a ``with`` block by :func:`active_hooks` (used by
:mod:`handformer.inspect`); they live in a :class:`contextvars.ContextVar`, so they belong to
the thread or asyncio task that registered them: two threads (or two requests of a server)
running the same model with different hooks never see each other's.

A hook is ``fn(tensor, name) -> Tensor | None``: it returns None to only look, or a tensor
of the same shape and dtype to replace the value the model goes on with.

This module is at the bottom of the package: it imports nothing from handformer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from threading import Lock
from typing import Protocol

import torch
from torch import Tensor, nn

__all__ = ["HookPoint", "HookFn", "active_hooks", "hooks_active", "HookError"]

HookFn = Callable[[Tensor, str], "Tensor | None"]
Registry = Mapping["HookPoint", tuple[tuple[str, HookFn], ...]]

_ACTIVE: ContextVar[Registry | None] = ContextVar("handformer_hooks", default=None)
# Hook blocks open in the whole process (any thread): while it is 0, a hook point returns at
# once, without looking up the context (the common case, and the cheapest check).
_open_blocks = 0
_open_lock = Lock()


class Shard(Protocol):
    """What a hook point of a sharded module holds (see :mod:`handformer.distributed`)."""

    def gather(self, x: Tensor) -> Tensor:
        """This rank's piece -> the full tensor (every rank takes part)."""

    def local(self, x: Tensor) -> Tensor:
        """The full tensor -> this rank's piece."""


class HookError(ValueError):
    """A hook returned something the model cannot go on with (wrong type, shape or dtype)."""


class HookPoint(nn.Module):
    """A named point in a forward pass: returns its input, unless a hook listens.

    It has no parameters and no state; the hooks that listen are looked up in the current
    context (see :func:`active_hooks`). Inside ``torch.compile`` hook points are plain
    pass-throughs.

    Under tensor parallel (:mod:`handformer.distributed`) a hook point inside a sharded
    module holds a ``shard``: when a hook listens, the ranks' pieces are gathered into the
    full tensor for the hooks, and a replacement is cut back to this rank's piece.
    """

    shard: Shard | None = None  # set on the instance by handformer.distributed

    def __call__(self, x: Tensor) -> Tensor:  # cheaper than nn.Module.__call__: no hooks dicts
        if not _open_blocks or torch.compiler.is_compiling():
            return x
        active = _ACTIVE.get()
        if active is None:
            return x
        fns = active.get(self)
        if not fns:
            return x
        full = x if self.shard is None else self.shard.gather(x)  # (every rank's part)
        seen = full
        for name, fn in fns:
            seen = _apply(fn, seen, name)
        if seen is full:  # only looked: go on with the tensor itself
            return x
        return seen if self.shard is None else self.shard.local(seen)

    def forward(self, x: Tensor) -> Tensor:
        """Identity (what ``__call__`` computes when no hook listens)."""
        return x

    def listening(self) -> bool:
        """True when a hook is registered on this point in the current context."""
        if not _open_blocks or torch.compiler.is_compiling():
            return False
        active = _ACTIVE.get()
        return active is not None and bool(active.get(self))


def hooks_active() -> bool:
    """True when hooks are registered in the current context (a hook point may listen).

    Code that computes a forward pass without its hook points (the plain decoding step of
    :mod:`handformer.models.plain_step`) checks this and takes the modules' path instead.
    """
    return bool(_open_blocks) and bool(_ACTIVE.get())


def _apply(fn: HookFn, x: Tensor, name: str) -> Tensor:
    """Run one hook; check that a replacement has the shape and dtype of the original."""
    new = fn(x, name)
    if new is None:
        return x
    if not isinstance(new, Tensor):
        raise HookError(f"hook on {name!r} returned {type(new).__name__}; return a Tensor "
                        "(a replacement) or None (to leave the value as it is)")
    if new.shape != x.shape or new.dtype != x.dtype:
        raise HookError(f"hook on {name!r} returned shape {tuple(new.shape)} {new.dtype}, "
                        f"but the model's value there is {tuple(x.shape)} {x.dtype}; a "
                        f"replacement must have the same shape and dtype{_layout_hint(name)}")
    return new


def _layout_hint(name: str) -> str:
    """Where handformer's layout differs from TransformerLens': its q/k/v hooks."""
    last = name.rsplit(".", 1)[-1]
    if last in ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k"):
        return (f" ({last} is (B, heads, L, D) here, where TransformerLens' is (B, L, heads, "
                "D): transpose(1, 2) to and from its layout)")
    return ""


@contextmanager
def active_hooks(hooks: Mapping[HookPoint, tuple[tuple[str, HookFn], ...]]) -> Iterator[None]:
    """Register hooks for the ``with`` block, in this thread / task only.

    Args:
        hooks: hook point -> ``((name, fn), ...)``, the functions run in order. Hooks already
            active (an enclosing block) keep running, before these.
    """
    outer = _ACTIVE.get()
    merged: dict[HookPoint, tuple[tuple[str, HookFn], ...]] = dict(outer or {})
    for point, fns in hooks.items():
        merged[point] = merged.get(point, ()) + tuple(fns)
    global _open_blocks
    token = _ACTIVE.set(merged)
    with _open_lock:
        _open_blocks += 1
    try:
        yield
    finally:
        with _open_lock:
            _open_blocks -= 1
        _ACTIVE.reset(token)
