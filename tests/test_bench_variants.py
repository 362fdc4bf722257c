"""The variants benchmark runs end to end in quick mode (a smoke test, not a timing test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_variants_quick_mode_writes_results():
    env = {**os.environ, "HANDFORMER_BENCH_QUICK": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_variants.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "local_vs_fused_band" in proc.stdout
    quick_dir = Path(tempfile.gettempdir()) / "handformer-bench-quick"  # see benchmarks/common
    data = json.loads((quick_dir / "variants.json").read_text())
    head = data["headline"]
    assert set(head["ratios"]) >= {"local_vs_fused_band", "strided_vs_fused_mask",
                                   "linear_vs_fused", "linear_causal_vs_fused_causal"}
    # the variants computed what their references computed
    assert head["max_abs_diff"]["local_vs_fused_band"] < 1e-4
    assert head["max_abs_diff"]["strided_vs_fused_mask"] < 1e-4
    assert all(mib >= 0 for mib in data["peak_mib"]["local"].values())
