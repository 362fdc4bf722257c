"""Linear layers that read one input, with their weights stored back to back.

``q_proj``, ``k_proj`` and ``v_proj`` of a self-attention layer all multiply the same ``h``;
so do ``gate_proj`` and ``up_proj`` of a gated MLP. The modules stay separate (their names,
hook points and checkpoint keys are the readable ones), but their weights can live in one
tensor, each module's ``weight`` a view of its rows::

    packed = [W_q; W_k; W_v]        # (H*D + 2*H_kv*D, E), one allocation
    q_proj.weight = packed[:H*D]    # a view: same memory, an ordinary Parameter

Then one matrix product, ``h @ packed.T``, computes ``q``, ``k`` and ``v`` together, one call
instead of three. Each output feature is the same dot product; the BLAS may sum it in another
order for another matrix shape (MKL does for tiny matrices on some CPUs), so the results agree
to float rounding, and are bit-equal at the shapes of real models that we measured. That
matters in a decoding step, where a batch-1 step of a small model spends a good part of its
time on calls rather than arithmetic (see :mod:`handformer.models.plain_step`).

:func:`pack_linears` lays the weights out so; :func:`packed_linear` finds out, at the time it
is asked, whether they still are (an optimizer step or ``load_state_dict`` writes in place and
keeps the layout; ``model.to(torch.float16)``, ``copy.deepcopy`` or assigning a new
``Parameter`` ends it, and the caller goes back to one product per module).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["pack_linears", "packable", "empty_packed", "packed_linear"]


def _compatible(tensors: list[Tensor]) -> bool:
    first = tensors[0]
    return all(t.dtype == first.dtype and t.device == first.device
               and t.shape[1:] == first.shape[1:] for t in tensors)


def packable(*linears: nn.Linear) -> bool:
    """Whether :func:`pack_linears` packs ``linears``: two or more, with weights of one input
    size, dtype and device, and a bias on every one or on none."""
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len(linears) < 2 or not _compatible(weights):
        return False
    if all(b is None for b in biases):
        return True
    return all(b is not None for b in biases) and _compatible(biases)  # type: ignore[arg-type]


def pack_linears(*linears: nn.Linear) -> None:
    """Store the weights of ``linears`` (same input size, dtype and device) back to back in
    one new tensor, and their biases too when every one has a bias; each module's ``weight``
    (and ``bias``) becomes a view of its rows. Values and ``requires_grad`` are unchanged.
    Linears that cannot be packed (different input sizes, dtypes or devices; some with a bias
    and some without) are left as they are.

    Args:
        linears: two or more ``nn.Linear`` modules that will multiply the same input.
    """
    if not packable(*linears):
        return
    first = linears[0].weight
    owners = {id(getattr(m, name)): (m, name) for m in linears for name in ("weight", "bias")}
    for param, view in empty_packed(*linears, dtype=first.dtype, device=first.device):
        with torch.no_grad():
            view.copy_(param)
        module, name = owners[id(param)]
        setattr(module, name, nn.Parameter(view, requires_grad=param.requires_grad))


def empty_packed(*linears: nn.Linear, dtype: torch.dtype, device: torch.device | str
                 ) -> list[tuple[nn.Parameter, Tensor]]:
    """Uninitialised memory laid out as :func:`pack_linears` lays ``linears`` out, for a loader
    that fills it straight from a checkpoint (no second copy, no packing afterwards).

    The modules may live on the ``meta`` device: only their shapes are read.

    Args:
        linears: the modules of one group (as for :func:`pack_linears`).
        dtype: the dtype of the new memory.
        device: where it lives.

    Returns:
        ``(parameter, view)`` for each weight, then each bias when all have one: ``view`` is
        that parameter's rows in the new tensor. Empty when :func:`packable` says no.
    """
    if not packable(*linears):
        return []
    pairs: list[tuple[nn.Parameter, Tensor]] = []
    for name in ("weight", "bias"):
        params = [getattr(m, name) for m in linears]
        if params[0] is None:  # no biases
            continue
        rows = [p.shape[0] for p in params]
        packed = torch.empty((sum(rows), *params[0].shape[1:]), dtype=dtype, device=device)
        pairs += zip(params, packed.split(rows), strict=True)  # views (out_i, ...) each
    return pairs


def _back_to_back(tensors: list[Tensor]) -> Tensor | None:
    """One tensor viewing ``tensors`` (contiguous, each starting where the previous one ends
    in one storage) as their concatenation along dim 0, or None if they are not so."""
    if not _compatible(tensors) or not all(t.is_contiguous() for t in tensors):
        return None
    storage = tensors[0].untyped_storage().data_ptr()
    offset = tensors[0].storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    first = tensors[0].detach()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    strides = (math.prod(first.shape[1:]), *first.stride()[1:])  # contiguous: (E, 1) or (1,)
    return first.as_strided(shape, strides, first.storage_offset())  # (sum of out, ...)


def packed_linear(*linears: nn.Linear) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` of ``linears`` as one linear layer (views of their memory, no copy)
    when :func:`pack_linears` laid them out and they still are so; None otherwise.

    ``F.linear(h, *packed_linear(a, b))`` equals ``torch.cat([a(h), b(h)], -1)``.

    Returns:
        ``(weight (sum of out, in), bias (sum of out,) or None)``, or None.
    """
    weight = _back_to_back([m.weight for m in linears])
    biases = [m.bias for m in linears]
    if weight is None or len({b is None for b in biases}) > 1:  # some with a bias, some not
        return None
    if biases[0] is None:
        return weight, None
    bias = _back_to_back(biases)  # type: ignore[arg-type]
    return None if bias is None else (weight, bias)
