"""The LLM benchmark runs end to end in quick mode (a smoke test, not a timing test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_llm_quick_mode_writes_results(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "HANDFORMER_BENCH_QUICK": "1", "TMPDIR": str(tmp_path),
           "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_llm.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "handformer-bench-quick" / "llm.json").read_text())
    (run,) = data["threads"]
    assert run["forward_ms"]["handformer"] > 0 and run["forward_ms"]["transformers"] > 0
    assert [d["context"] for d in run["decode"]] == [16, 64]
    assert all(d["identical_tokens"] and d["ms_per_token"]["floor"] > 0 for d in run["decode"])
    kv = data["kv_cache"]
    assert kv["ratio_vs_mha"] == kv["expected_ratio"] == 0.5  # 2 KV heads of 4
    assert kv["sliding_layer_tokens"] == kv["sliding_window"] - 1  # the window, not 64
    assert data["load_memory"]["model_bytes"] > 0  # (a tiny model: imports dominate RSS)
    assert len(data["load_average_start"]) == 3 and data["streaming"]["floor_gb_per_s"] > 0
    (int8,) = data["int8"]["models"]  # section 6 (llm_int8.py): the shipped SmolLM2 alone
    assert int8["agreement"]["top1"] >= 0.9 and int8["threads"][0]["decode_cpu_ms"]["int8"] > 0
    assert int8["load"]["int8"]["peak_rss_growth_bytes"] > 0 and int8["floor_ms"]["int8"] > 0
    assert int8["agreement_int4"]["top1"] >= 0.9
    assert int8["load"]["int4"]["peak_rss_growth_bytes"] > 0
    assert int8["threads"][0]["decode_cpu_ms"]["int4"] > 0  # quantize="int4" in the same rounds
    bf16 = data["bfloat16"]  # llm_bf16.py: bfloat16 against float32 and the floor
    assert bf16["bytes_bf16"] * 2 == bf16["bytes_f32"]
    assert all(r["ms_per_token"]["bfloat16"] > 0 and r["floor16_ms"] > 0 for r in bf16["rows"])
