"""Tensor parallel: time and communication of a model split over N ranks.

Run under ``torchrun`` (it is not one of the ``bench_*.py`` that ``run_all.py`` runs)::

    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py            # CPU, gloo
    torchrun --nproc-per-node 1 benchmarks/tensor_parallel.py            # the same code, 1 rank
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --device cuda   # NCCL, one GPU each

Each rank loads its slices (``load_lm(source, mesh=mesh)``); rank 0 prints, per vocabulary
placement (replicated, sharded): each rank's parameter bytes, the median prefill time for
``--tokens`` tokens, the median time per decoded token, and the bytes each collective moves per
layer (worked out from the shapes: one all-reduce of ``(B, L, E)`` after the attention and one
after the MLP; with the vocabulary sharded, one all-reduce of the embeddings and one
all-gather of the logits per forward). With one rank it also times the model loaded without a
mesh (the single-process baseline, in the same run). ``--check`` loads the whole model too
and prints the largest logit difference (for small models only: that rank holds it all).
Wall time on a shared machine is noisy: compare figures from one run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from handformer.pretrained import load_lm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, arg: object, device: torch.device) -> float:  # noqa: ANN001
    """Wall seconds of ``fn(arg)``, the ranks starting together."""
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    fn(arg)
    _sync(device)
    return time.perf_counter() - start


def _median_seconds(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up
    return statistics.median(_seconds(lambda _: fn(), None, device) for _ in range(repeats))


def _local_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        p = p.to_local() if hasattr(p, "to_local") else p
        total += p.numel() * p.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=128, help="prompt length for prefill")
    parser.add_argument("--decode", type=int, default=16, help="tokens to decode")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    parser.add_argument("--check", action="store_true", help="compare logits with one process")
    parser.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    torch.manual_seed(0)
    prompt = torch.randint(0, 1000, (1, args.tokens), device=device)

    from handformer.pretrained import lm_sharded

    models = {vocab: lm_sharded.load_sharded(args.source, mesh=mesh, dtype=torch.float32,
                                             device=device, attention=None, tokenizer=False,
                                             vocab=vocab)[0]
              for vocab in ("replicate", "shard")}
    if world == 1:  # the single-process baseline, no mesh, in the same run
        models["no mesh"] = load_lm(args.source, tokenizer=False, device=device)[0]
    c = models["replicate"].config
    E, V = c.d_model, c.vocab_size

    def prefill(m: torch.nn.Module) -> None:
        m(prompt)

    def decode(m: torch.nn.Module) -> None:
        m.generate(prompt[:, :8], max_new_tokens=args.decode, do_sample=False)

    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for m in models.values():  # warm-up
            prefill(m), decode(m)
        for _ in range(args.repeats):  # interleaved: the machine's load hits all alike
            for name, m in models.items():
                for what, fn in (("prefill", prefill), ("decode", decode)):
                    times.setdefault((name, what), []).append(_seconds(fn, m, device))
    rows = []
    for name, model in models.items():
        sharded = name == "shard" and world > 1
        row = {"vocab": name, "ranks": world, "param_bytes": _local_bytes(model),
               "prefill_s": statistics.median(times[name, "prefill"]),
               "decode_s_per_token": statistics.median(times[name, "decode"]) / args.decode,
               "allreduce_bytes_per_layer_prefill": 2 * prompt.numel() * E * 4 * (world > 1),
               "allreduce_bytes_per_layer_decode": 2 * E * 4 * (world > 1),
               "vocab_bytes_per_forward_prefill": prompt.numel() * (E + V) * 4 * sharded,
               "layers": c.num_layers}
        if args.check and name != "no mesh":
            whole, _ = load_lm(args.source, tokenizer=False, device=device)
            with torch.inference_mode():
                row["max_logit_diff"] = float((whole(prompt).logits - model(prompt).logits)
                                              .abs().max())
            del whole
        rows.append(row)
    # the collective alone: one all-reduce of a decode step's (1, 1, E) and a prefill's (1, L, E)
    x1, xl = torch.ones(1, 1, E, device=device), torch.ones(1, args.tokens, E, device=device)
    comm = {f"allreduce_{tuple(x.shape)}_s": _median_seconds(lambda x=x: dist.all_reduce(x),
                                                            device, 20) for x in (x1, xl)}
    if rank == 0:
        print(f"{args.source} on {world} rank(s), {args.device}, {args.threads} thread(s) each")
        for r in rows:
            extra = f"  max|dlogits| {r['max_logit_diff']:.2e}" if "max_logit_diff" in r else ""
            print(f"  vocab {r['vocab']:9}  params/rank {r['param_bytes'] / 2**20:7.1f} MiB  "
                  f"prefill {args.tokens} tok {r['prefill_s'] * 1e3:8.1f} ms  "
                  f"decode {r['decode_s_per_token'] * 1e3:7.2f} ms/token{extra}")
        for name, seconds in comm.items():
            print(f"  {name}: {seconds * 1e6:.0f} us")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"rows": rows, "comm": comm, "source": args.source,
                           "device": args.device}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
