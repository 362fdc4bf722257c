"""The attribution-graph benchmark runs end to end in quick mode (a smoke test, not a timing
test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_graphs_quick_mode_writes_results(tmp_path: Path) -> None:
    env = {**os.environ, "HANDFORMER_BENCH_QUICK": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_graphs.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "handformer-bench-quick" / "graphs.json").read_text())
    assert data["tokens"] == 16 and data["feature_nodes"] == 64
    assert set(data["stages_s"]) == {"replacement", "forward", "logit_rows", "feature_rows",
                                     "assemble", "scores"}
    assert 0 <= data["replacement_score"] <= 1 and 0 <= data["completeness_score"] <= 1
