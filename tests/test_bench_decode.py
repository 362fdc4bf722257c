"""The decoding benchmark runs end to end in quick mode (a smoke test, not a timing test)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_decode_quick_mode_writes_results(tmp_path: Path) -> None:
    env = {**os.environ, "HANDFORMER_BENCH_QUICK": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "per-token latency" in done.stdout and "linear decoding" in done.stdout
    data = json.loads((tmp_path / "handformer-bench-quick" / "decode.json").read_text())
    assert [r["context"] for r in data["long_contexts"]] == [32, 64]
    assert data["linear_memory_max_over_min"] == 1.0  # the linear state does not grow
    assert data["long_contexts"][1]["full_cache_kib"] > data["long_contexts"][0]["full_cache_kib"]
    # the comparison with transformers' generate ran, on identical greedy tokens
    peer = data["vs_transformers"]["rows"]
    assert [r["context"] for r in peer] == [16, 64]
    # (per-token times are differences of two timings: in quick mode, on a loaded machine, one
    # can come out negative, so only their presence is checked here)
    assert all(r["identical_tokens"] and math.isfinite(r["transformers_ms_per_token"])
               for r in peer)
    assert "vs transformers, context 64" in done.stdout
    # the machine's weight-streaming speed by working-set size is recorded beside the timings
    assert [r["megabytes"] for r in data["memory_regime"]] == [2, 4]
    assert all(r["gb_per_s"] > 0 for r in data["memory_regime"])
