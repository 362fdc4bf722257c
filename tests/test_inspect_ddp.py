"""Sweeps over a list of prompts under ``torchrun``: two gloo processes on CPU each take a
share of the prompts and the reduced results equal one process's within 1e-6."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = '''
import sys

import torch
import torch.distributed as dist

import handformer as hf
from handformer.inspect import (attribution_patching, detect_heads, head_ablation_sweep,
                                patching_sweep)
from handformer.inspect.shares import my_share

torch.set_num_threads(1)
out = sys.argv[1]
if sys.argv[2] == "ddp":
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = hf.CausalLM(hf.CausalLMConfig(vocab_size=30, max_len=16, d_model=16, num_heads=4,
                                      num_layers=2, d_ff=32)).eval()
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.35)
torch.manual_seed(1)
cleans = [torch.randint(0, 28, (1, 6 + i % 2)) for i in range(5)]
corrupts = []
for c in cleans:
    x = c.clone()
    x[0, 2] = 29
    corrupts.append(x)
metric = lambda o: o.logits[0, -1, 3] - o.logits[0, -1, 4]
results = {
    "ablation": head_ablation_sweep(model, cleans, metric, batch_size=3),
    "patching": patching_sweep(model, cleans, corrupts, metric, hook="k"),
    "attribution": attribution_patching(model, cleans, corrupts, metric, hook="z"),
    "detect": detect_heads(model, [c[0] for c in cleans], "previous_token", batch_size=2),
    "share": torch.tensor([i for i, _ in my_share(list(range(5)))]),
}
rank = dist.get_rank() if dist.is_initialized() else 0
torch.save(results, f"{out}.{rank}")
if dist.is_initialized():
    dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    script = tmp_path / "sweeps.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    one = subprocess.run([sys.executable, str(script), str(tmp_path / "one"), "single"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script),
         str(tmp_path / "two"), "ddp"],
        capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    single = torch.load(tmp_path / "one.0")
    rank0, rank1 = torch.load(tmp_path / "two.0"), torch.load(tmp_path / "two.1")
    # each rank measured its own share of the five prompts
    assert single["share"].tolist() == [0, 1, 2, 3, 4]
    assert rank0["share"].tolist() == [0, 2, 4] and rank1["share"].tolist() == [1, 3]
    for key in ("ablation", "patching", "attribution", "detect"):
        assert single[key].abs().max() > 0, key
        for ranked in (rank0, rank1):  # every rank holds the reduced result
            torch.testing.assert_close(ranked[key], single[key], atol=1e-6, rtol=0)
    assert rank0["patching"].shape == (2, 4)
