"""Resume is exact; SIGKILL while writing a checkpoint loses only the steps since the last one;
Ctrl-C saves and exits; corrupt or mismatched checkpoints are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.train import TrainConfig, train
from handformer.train.checkpoint import list_checkpoints, verify_checkpoint

# A tiny run with dropout, so that restoring the RNG state matters.
SMALL = dict(task="copy", length=4, num_symbols=6, eval_size=20, num_layers=1, d_model=32,
             num_heads=2, d_ff=64, dropout=0.1, steps=16, batch_size=16, warmup=4,
             log_every=1, eval_every=8, ckpt_every=5, keep=2, progress=False,
             threads=1)
ARGS = ["copy", "--length", "4", "--num-symbols", "6", "--eval-size", "20", "--layers", "1",
        "--d-model", "32", "--heads", "2", "--d-ff", "64", "--dropout", "0.1", "--steps", "16",
        "--batch-size", "16", "--warmup", "4", "--log-every", "1", "--eval-every", "8",
        "--ckpt-every", "5", "--keep", "2", "--no-progress", "--threads", "1"]


def _losses(run_dir: Path) -> list[tuple[str, int, float]]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["split"], r["step"], r["loss"]) for r in records]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handformer", "train", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    result = train(TrainConfig(**SMALL), run_dir)
    assert result.finished and result.step == 16
    return run_dir


def test_interrupted_and_resumed_equals_uninterrupted(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = train(TrainConfig(**SMALL, stop_after=7), run_dir)
    assert not first.finished and first.step == 7
    assert [s for s, _ in list_checkpoints(run_dir)] == [5, 7]
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert _losses(run_dir) == _losses(reference)  # bit for bit, every step and evaluation
    assert ((run_dir / "model.safetensors").read_bytes()
            == (reference / "model.safetensors").read_bytes())
    assert [s for s, _ in list_checkpoints(run_dir)] == [15, 16]  # the last K=2 kept
    # resuming a finished run changes nothing
    summary = (run_dir / "summary.json").read_text()
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert (run_dir / "summary.json").read_text() == summary
    assert json.loads(summary)["final_eval"]["step"] == 16


def test_sigkill_while_writing_a_checkpoint(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(*ARGS, "--out", str(run_dir), env={"HANDFORMER_TEST_KILL_DURING_SAVE": "10"})
    assert proc.returncode == -signal.SIGKILL
    ckpts = run_dir / "checkpoints"
    partial = [p for p in ckpts.iterdir() if p.name.startswith(".tmp-step-00000010")]
    assert len(partial) == 1  # the half-written checkpoint of step 10 ...
    assert [s for s, _ in list_checkpoints(run_dir)] == [5]  # ... is not a checkpoint
    assert max(step for _, step, _ in _losses(run_dir)) == 10  # metrics ran ahead
    proc = _cli("--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]  # debris removed
    assert _losses(run_dir) == _losses(reference)  # resumed from step 5, nothing lost


def test_ctrl_c_saves_a_checkpoint_and_exits(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*ARGS, "--steps", "100000"]  # a long run (the last --steps wins)
    proc = subprocess.Popen([sys.executable, "-m", "handformer", "train", *args, "--out",
                             str(run_dir)], stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 60
    while not (metrics.is_file() and metrics.stat().st_size) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted at step" in err and "--resume" in err
    step, path = list_checkpoints(run_dir)[-1]
    verify_checkpoint(path)
    assert step == int(err.split("interrupted at step ")[1].split(";")[0])


def test_corrupt_or_mismatched_checkpoint_is_refused(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    train(TrainConfig(**{**SMALL, "steps": 5}), run_dir)
    step, path = list_checkpoints(run_dir)[-1]
    # another model's checkpoint dropped into the run: refused, whatever its integrity
    other = tmp_path / "other"
    train(TrainConfig(**{**SMALL, "steps": 5, "d_model": 16}), other)
    (path.parent / "step-00000009").symlink_to(list_checkpoints(other)[-1][1])
    assert main(["train", "--resume", str(run_dir), "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "another model configuration" in err and "d_model" in err
    (path.parent / "step-00000009").unlink()
    # a truncated file: refused before any byte is used
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["train", "--resume", str(run_dir), "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "truncated or corrupt" in err
    assert "step-00000005" in err
