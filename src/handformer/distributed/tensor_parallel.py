"""Tensor parallel for :class:`~handformer.CausalLM`: :func:`parallelize`.

The model stays the one readable class; :func:`parallelize` swaps its weights for this rank's
slices and adds the communication as forward hooks, through PyTorch's own entry point,
``torch.distributed.tensor.parallel.parallelize_module``, with one
:class:`~torch.distributed.tensor.parallel.ParallelStyle` per kind of block:

* :class:`HeadParallel` on every ``blocks.i.attn``: q/k/v column-wise (each projection's
  rows of this rank's whole heads; the three stay packed back to back, so the packed tensor
  holds each part's slice, not a slice of the concatenation), ``out_proj`` row-wise (its
  columns of those heads), then one all-reduce of the ``(B, L, E)`` output. Which heads: see
  :mod:`handformer.distributed.plan` (uneven counts split 5/4, never inside a head).
* :class:`FeedForwardParallel` on every ``blocks.i.mlp``: gate/up (or ``linear1``) rows,
  down (or ``linear2``) columns, one all-reduce.
* The token embedding and the LM head: replicated (the default), or with
  ``vocab="shard"`` PyTorch's stock ``RowwiseParallel`` / ``ColwiseParallel`` on DTensor
  parameters (``Shard(0)``, the vocabulary): one all-reduce of the embeddings and one
  all-gather of the logits per forward.

Why not ``ColwiseParallel`` for the heads: a DTensor ``Shard`` splits as ``torch.chunk``
does, so SmolLM2's 9 heads x 64 rows over 2 ranks would be cut at row 288, inside head 4.
:class:`HeadParallel` keeps plain local tensors of whole heads instead.

Hook points inside a sharded block see full tensors: each holds an
:class:`~handformer.distributed.shards.IndexShard` that gathers the ranks' heads (or MLP
units) when a hook listens, and cuts a replacement back to this rank's part. Nothing is
gathered when nothing listens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from handformer.distributed.plan import kv_heads_for, split_evenly, vocab_range
from handformer.distributed.shards import IndexShard, agree, sum_output
from handformer.layers import FeedForward, GatedFeedForward, MultiHeadAttention
from handformer.models.causal_lm import CausalLM
from handformer.packing import pack_linears

__all__ = ["parallelize", "HeadParallel", "FeedForwardParallel", "Reader",
           "tensor_parallel_size", "VOCAB"]

# read(parameter name, rows or None, columns or None) -> that part of the full parameter
Reader = Callable[[str, "Tensor | None", "Tensor | None"], Tensor]
VOCAB = ("replicate", "shard")
_SIZE = [1]  # the tensor-parallel degree of the models this process sharded


def tensor_parallel_size() -> int:
    """How many ranks share each model :func:`parallelize` sharded in this process (1: none).

    Sweeps over prompts (:mod:`handformer.inspect.shares`) give each group of that many
    ranks the same prompts: they run one model together."""
    return _SIZE[0]


def _rows(units: list[int], size: int) -> Tensor:
    """The rows of whole units (heads of ``size`` rows): ``[u * size, (u + 1) * size)``."""
    return (torch.tensor(units, dtype=torch.long)[:, None] * size
            + torch.arange(size)).reshape(-1)  # (len(units) * size,)


def _install(module: nn.Module, name: str, value: Tensor | None) -> None:
    module.register_parameter(name, None if value is None
                              else nn.Parameter(value, requires_grad=False))


class HeadParallel(ParallelStyle):
    """Shard one :class:`~handformer.MultiHeadAttention` by whole heads (see the module).

    Args:
        name: the module's name in the model (``"blocks.3.attn"``), for ``read``.
        read: gives this rank's part of a parameter (see :func:`parallelize`).
        device: where the parts go.
    """

    def __init__(self, name: str, read: Reader, device: torch.device) -> None:
        super().__init__()
        self.name, self.read, self.device = name, read, device

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        attn: MultiHeadAttention = module  # type: ignore[assignment]
        rank, N, group = device_mesh.get_local_rank(), device_mesh.size(), device_mesh.get_group()
        H, H_kv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        every_q = [list(r) for r in split_evenly(H, N)]
        every_kv = [kv_heads_for(range(q[0], q[-1] + 1), H, H_kv) for q in every_q]
        q_rows, kv_rows = _rows(every_q[rank], D), _rows(every_kv[rank], D)

        def part(key: str, rows: Tensor | None, cols: Tensor | None) -> Tensor:
            return self.read(f"{self.name}.{key}", rows, cols).to(self.device)

        for key, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            linear = getattr(attn, key)
            _install(linear, "weight", part(f"{key}.weight", rows, None))
            if linear.bias is not None:
                _install(linear, "bias", part(f"{key}.bias", rows, None))
        _install(attn.out_proj, "weight", part("out_proj.weight", None, q_rows))
        if attn.out_proj.bias is not None:  # added once, by rank 0, before the sum
            _install(attn.out_proj, "bias", part("out_proj.bias", None, None)
                     if rank == 0 else None)
        pack_linears(attn.q_proj, attn.k_proj, attn.v_proj)  # each part's slice, back to back
        heads = IndexShard(1, every_q, rank, group)  # (B, H, ...)
        kv = IndexShard(1, every_kv, rank, group)  # (B, H_kv, ...)
        per_head = IndexShard(2, every_q, rank, group)  # (B, L, H, ...)
        for point, shard in (("hook_q", heads), ("hook_rot_q", heads), ("hook_k", kv),
                             ("hook_v", kv), ("hook_rot_k", kv), ("hook_attn_scores", heads),
                             ("hook_pattern", heads), ("hook_z", per_head),
                             ("hook_result", per_head)):
            if hasattr(attn, point):
                getattr(attn, point).shard = shard
        if attn.q_norm is not None:  # the QK-norms' points are per head: (B, H, L, 1 or D)
            for norm, shard in ((attn.q_norm, heads), (attn.k_norm, kv)):
                norm.hook_scale.shard = norm.hook_normalized.shard = shard
        attn.register_forward_hook(sum_output(group, heads))
        return attn


class FeedForwardParallel(ParallelStyle):
    """Shard one MLP (:class:`~handformer.GatedFeedForward` or
    :class:`~handformer.FeedForward`) by hidden units: the input projections' rows, the
    output projection's columns, one all-reduce.

    Args:
        name, read, device: as :class:`HeadParallel`.
    """

    def __init__(self, name: str, read: Reader, device: torch.device) -> None:
        super().__init__()
        self.name, self.read, self.device = name, read, device

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank, N, group = device_mesh.get_local_rank(), device_mesh.size(), device_mesh.get_group()
        if isinstance(module, GatedFeedForward):
            inputs, output = ["gate_proj", "up_proj"], "down_proj"
        elif isinstance(module, FeedForward):
            inputs, output = ["linear1"], "linear2"
        else:
            raise TypeError(f"{self.name} is a {type(module).__name__}, not an MLP handformer "
                            "shards")
        d_ff = getattr(module, output).in_features
        every = [list(r) for r in split_evenly(d_ff, N)]
        rows = torch.tensor(every[rank], dtype=torch.long)

        def part(key: str, r: Tensor | None, c: Tensor | None) -> Tensor:
            return self.read(f"{self.name}.{key}", r, c).to(self.device)

        for key in inputs:
            linear = getattr(module, key)
            _install(linear, "weight", part(f"{key}.weight", rows, None))
            if linear.bias is not None:
                _install(linear, "bias", part(f"{key}.bias", rows, None))
        down = getattr(module, output)
        _install(down, "weight", part(f"{output}.weight", None, rows))
        if down.bias is not None:
            _install(down, "bias", part(f"{output}.bias", None, None) if rank == 0 else None)
        if len(inputs) == 2:
            pack_linears(module.gate_proj, module.up_proj)
        units = IndexShard(-1, every, rank, group)  # (B, L, d_ff)
        for point in ("hook_pre", "hook_pre_linear", "hook_post"):
            if hasattr(module, point):
                getattr(module, point).shard = units
        module.register_forward_hook(sum_output(group))
        return module


def _check(model: object, mesh: object, vocab: object) -> None:
    if not isinstance(model, CausalLM):
        raise TypeError(f"parallelize shards a handformer CausalLM, got "
                        f"{type(model).__name__}")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise TypeError(f"mesh must be a 1-D torch.distributed DeviceMesh "
                        f"(init_device_mesh('cpu', (N,))), got {mesh!r:.80}")
    if vocab not in VOCAB:
        raise ValueError(f"vocab must be one of {list(VOCAB)}, got {vocab!r}")
    if getattr(model, "_tensor_parallel", None) is not None:
        raise ValueError("this model is already sharded (parallelize was called on it)")
    N, H = mesh.size(), model.config.num_heads
    if N > H:
        raise ValueError(f"mesh of {N} ranks for num_heads={H}: tensor parallel gives each "
                         f"rank whole heads, so at most {H} ranks")
    for name, module in model.named_modules():
        if name.endswith(("_proj", "linear1", "linear2")) or name == "lm_head":
            weight = getattr(module, "weight", None)
            if type(module) is not nn.Linear or not isinstance(weight, Tensor) \
                    or not weight.is_floating_point():
                kind = f"{type(module).__module__}.{type(module).__name__}"
                raise ValueError(f"tensor parallel shards float nn.Linear projections; {name} "
                                 f"is a {kind} (a quantized model?): load it without "
                                 "quantize= to run it on a mesh")


def parallelize(model: CausalLM, mesh: DeviceMesh, *, vocab: str = "replicate",
                read: Reader | None = None, device: str | torch.device | None = None
                ) -> CausalLM:
    """Shard ``model`` over ``mesh`` in place: this rank keeps its heads and MLP units.

    Call it on every rank of the mesh (``torchrun --nproc-per-node N``, then
    ``mesh = init_device_mesh("cpu", (N,))`` or ``("cuda", (N,))``), with the same model.
    Afterwards ``model(ids)``, ``generate``, ``run_with_cache`` and the hooks give what one
    process gives, every rank the same (run the same calls on every rank).

    Args:
        model: a :class:`~handformer.CausalLM`, whole on every rank, or on the ``meta``
            device with ``read`` giving the parts (what ``load_lm(..., mesh=mesh)`` does, so
            that no rank holds the whole model).
        mesh: a 1-D ``DeviceMesh`` of at most ``num_heads`` ranks.
        vocab: ``"replicate"`` (every rank holds the embedding and the LM head) or
            ``"shard"`` (each holds its range of token ids; DTensor parameters).
        read: ``read(name, rows, cols)`` -> the rows and columns (``LongTensor`` or None:
            all) of parameter ``name``; by default the model's own parameters.
        device: where this rank's parts go (None: where the model's parameters are, the
            CPU for a model on ``meta``); ``f"cuda:{local_rank}"`` with NCCL.

    Returns:
        ``model``, sharded, in eval mode, its parameters without gradients (the ranks
        agree that each one loaded its part).

    Raises:
        TypeError: for a model that is not a CausalLM, a mesh that is not a 1-D DeviceMesh.
        ValueError: for more ranks than heads, an unknown ``vocab``, a model sharded
            already, or projections that are not float ``nn.Linear`` (a quantized model).
        CheckpointError: on every rank, naming the rank, when one rank's ``read`` failed.
    """
    _check(model, mesh, vocab)
    rank, N = mesh.get_local_rank(), mesh.size()
    whole = dict(model.named_parameters())
    read = read or (lambda name, rows, cols: _index(whole[name], rows, cols))
    if device is None:
        device = next(p.device for p in [*model.parameters(), torch.empty(0)]
                      if p.device.type != "meta")
    device = torch.device(device)
    error = None
    try:
        plan: dict[str, ParallelStyle] = {}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.attn"] = HeadParallel(f"blocks.{i}.attn", read, device)
            plan[f"blocks.{i}.mlp"] = FeedForwardParallel(f"blocks.{i}.mlp", read, device)
        tied = model.config.tie_weights
        if vocab == "shard":
            ids = vocab_range(model.config.vocab_size, N, rank)
            rows = torch.arange(ids.start, ids.stop)
            for key in ("tok_emb",) + (() if tied else ("lm_head",)):
                full = getattr(model, key).weight
                local = read(f"{key}.weight", rows, None).to(device)
                dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                        shape=full.shape, stride=(full.shape[1], 1))
                getattr(model, key).weight = nn.Parameter(dt, requires_grad=False)
            if tied:
                model.lm_head.weight = model.tok_emb.weight
            plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
            plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh, plan)
        if tied and vocab == "shard":  # the stock styles wrap the DTensor in new Parameters
            model.lm_head.weight = model.tok_emb.weight
        for name, p in list(model.named_parameters()):  # the replicated rest
            if p.device.type == "meta":
                owner, _, leaf = name.rpartition(".")
                _install(model.get_submodule(owner), leaf, read(name, None, None).to(device))
        if tied and vocab == "replicate":
            model.lm_head.weight = model.tok_emb.weight
        model.requires_grad_(False)  # forward passes only (no backward through collectives)
        for module in model.modules():  # buffers (rotary tables) follow the parameters
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[key] = buffer.to(device)
    except Exception as exc:  # told to every rank below, then raised there
        error = exc
    agree(error, mesh.get_group(), "load its part of the model")
    model._tensor_parallel = mesh  # type: ignore[assignment]
    _SIZE[0] = N
    return model.eval()


def _index(full: Tensor, rows: Tensor | None, cols: Tensor | None) -> Tensor:
    """``full[rows][:, cols]`` (None: all), a copy: the whole tensor can be dropped."""
    out = full.detach()
    if rows is not None:
        out = out.index_select(0, rows.to(out.device))
    if cols is not None:
        out = out.index_select(1, cols.to(out.device))
    return out.clone() if out is full else out
