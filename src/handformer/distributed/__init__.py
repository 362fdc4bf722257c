"""Tensor parallel on ``torch.distributed``: one model over several processes (or machines).

::

    torchrun --nproc-per-node 2 script.py        # on each machine (--nnodes, --rdzv-endpoint)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from handformer.pretrained import load_lm

    dist.init_process_group("gloo")              # "nccl" on GPUs
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, tok = load_lm("smollm2-135m-instruct", mesh=mesh)   # each rank reads its slices

:func:`parallelize` shards a model already in memory. See ``docs/distributed.md``
("Beyond one machine") for what is sharded and what it costs.

Not to be confused with :mod:`handformer.train.distributed`, data parallel training (DDP).
"""

from handformer.distributed.plan import kv_heads_for, split_evenly, vocab_range
from handformer.distributed.tensor_parallel import (
    VOCAB,
    FeedForwardParallel,
    HeadParallel,
    Reader,
    parallelize,
    tensor_parallel_size,
)

__all__ = ["parallelize", "HeadParallel", "FeedForwardParallel", "Reader", "VOCAB",
           "tensor_parallel_size", "split_evenly", "kv_heads_for", "vocab_range"]
