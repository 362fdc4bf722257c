"""The inspect benchmark runs end to end in quick mode (a smoke test, not a timing test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_inspect_quick_mode_writes_results(tmp_path: Path) -> None:
    env = {**os.environ, "HANDFORMER_BENCH_QUICK": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_inspect.py"),
                           "flow"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "## Attention flow" in done.stdout
    data = json.loads((tmp_path / "handformer-bench-quick" / "inspect.json").read_text())
    flow = data["parts"]["flow"]["data"]
    assert flow["tokens"] == 16 and flow["agrees_with_reference"] is True
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_inspect.py"),
                          "nope"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "parts are flow" in bad.stdout
