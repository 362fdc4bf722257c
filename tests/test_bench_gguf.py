"""The GGUF loading benchmark runs end to end in quick mode (a smoke test, not a timing test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gguf_quick_mode_writes_results(tmp_path: Path) -> None:
    env = {**os.environ, "HANDFORMER_BENCH_QUICK": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gguf.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "handformer-bench-quick" / "gguf.json").read_text())
    smol = data["models"]["smollm2-135m-instruct"]
    ours = smol["handformer"]
    assert ours["params"] == 134_515_008  # SmolLM2-135M, the tied head counted once
    assert ours["float32_bytes"] == 4 * ours["params"]
    assert ours["seconds"] > 0 and ours["peak_growth_bytes"] > ours["float32_bytes"] // 2
    assert smol["read_gguf_s"] > 0 and "smollm2-135m-instruct" in done.stdout
