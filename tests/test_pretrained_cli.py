"""``handformer embed`` and the embedding benchmark's quick mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.commands.embed import similarity_table
from handformer.pretrained import embed

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The girl is carrying a baby."]


def test_embed_prints_cosine_table(capsys) -> None:
    assert main(["embed", *SENTENCES]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].split() == ["[0]", "[1]", "[2]"]
    v = embed(SENTENCES)
    want = (v @ v.T).tolist()
    for i, line in enumerate(lines[1:]):
        assert line.startswith(f"[{i}] ")
        values = [float(x) for x in line.split()[-3:]]
        assert values == pytest.approx(want[i], abs=1e-3)
        assert values[i] == pytest.approx(1.0, abs=1e-3)
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_embed_json_prints_vectors(capsys) -> None:
    assert main(["embed", "--json", *SENTENCES[:2]]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["sentence"] for d in data] == SENTENCES[:2]
    got = torch.tensor([d["embedding"] for d in data])
    torch.testing.assert_close(got, embed(SENTENCES[:2]), atol=1e-6, rtol=0)


def test_embed_with_model_folder(tmp_path, capsys) -> None:
    from pretrained_util import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    assert main(["embed", "--json", "--model", str(tmp_path), "the cat sat"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["embedding"]) == 32


@pytest.mark.parametrize("argv, message", [
    (["embed", ""], "text 0 is empty"),
    (["embed", "x", "--model", "/no/such/folder"], "no checkpoint folder at /no/such/folder"),
    (["embed", "x", "--batch-size", "0"], "batch_size must be a positive integer"),
])
def test_embed_errors_are_one_line(capsys, argv, message) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("handformer embed: error: ") and message in err
    assert err.count("\n") == 1


def test_similarity_table_cuts_long_labels() -> None:
    table = similarity_table(["short", "x" * 40], [[1.0, 0.5], [0.5, 1.0]], width=10)
    assert "xxxxxxxxx…" in table and "x" * 11 not in table


@pytest.mark.slow
def test_bench_embed_quick_mode_writes_results(tmp_path) -> None:
    env = {**os.environ, "HANDFORMER_BENCH_QUICK": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_embed.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "throughput ratio" in done.stdout and "peak RSS growth" in done.stdout
    data = json.loads((tmp_path / "handformer-bench-quick" / "embed.json").read_text())
    assert data["throughput"]["sentences"] == 8
    assert data["throughput"]["max_abs_diff"] < 1e-5
    assert data["loading"]["handformer"]["peak_growth_bytes"] > 0
