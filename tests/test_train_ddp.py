"""``torchrun --nproc_per_node 2 -m handformer train``: DistributedDataParallel over gloo on
CPU gives the losses of one process with the same global batch; only rank 0 writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from handformer.train import TrainConfig, train

SMALL = dict(task="reverse", length=4, num_symbols=6, eval_size=20, num_layers=1, d_model=32,
             num_heads=2, d_ff=64, steps=12, batch_size=16, warmup=3, log_every=1,
             eval_every=6, ckpt_every=6, progress=False, device="cpu", threads=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_gloo_processes_match_one(tmp_path: Path) -> None:
    single = tmp_path / "single"
    train(TrainConfig(**SMALL), single)

    ddp = tmp_path / "ddp"
    args = []
    for key, value in SMALL.items():
        if key == "task":
            continue
        flag = {"num_layers": "layers", "num_heads": "heads"}.get(key, key).replace("_", "-")
        if key == "progress":
            args.append("--no-progress")
        else:
            args += [f"--{flag}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
         "-m", "handformer", "train", "reverse", *args, "--out", str(ddp)],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("finished at step 12") == 1  # rank 0 reports, rank 1 is quiet

    one, two = _records(single), _records(ddp)
    # exactly one writer: one record per logged step and evaluation, in order
    assert [(r["split"], r["step"]) for r in two] == [(r["split"], r["step"]) for r in one]
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a, b)
        if "accuracy" in a:
            assert b["accuracy"] == pytest.approx(a["accuracy"], abs=0.051)
    assert one[-1]["loss"] < one[0]["loss"]
    assert sorted(p.name for p in ddp.iterdir()) == sorted(p.name for p in single.iterdir())
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == [
        "step-00000006", "step-00000012"]
    state = json.loads((ddp / "checkpoints" / "step-00000012" / "trainer_state.json")
                       .read_text())
    assert state["world_size"] == 2 and state["step"] == 12
