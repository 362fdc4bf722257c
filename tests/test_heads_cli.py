"""``handformer heads``: each head's effect on the similarity of two sentences."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from handformer.cli import main
from handformer.pretrained import load_bert
from pretrained_util import tiny_checkpoint

A = "The animal didn't cross the street because it was too tired"
B = "The animal was exhausted."


def cosine_with_head_removed(layer: int, head: int) -> float:
    """Independent of handformer.inspect: a torch pre-hook zeroes the head's slice of the
    output projection's input."""
    model, tok = load_bert()
    enc = tok([A, B])
    mha = model.blocks[layer].attn
    D = mha.head_dim

    def zero(module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        x = args[0].clone()
        x[..., head * D:(head + 1) * D] = 0.0
        return (x,)

    handle = mha.out_proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            e = model.sentence_pooling(model(**enc).last_hidden_state, enc["attention_mask"])
    finally:
        handle.remove()
    return float(torch.cosine_similarity(e[0], e[1], dim=0))


def test_heads_prints_the_strongest_heads_and_draws_them(tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["heads", A, B, "--out", str(tmp_path)]) == 0
    lines = out.getvalue().splitlines()
    clean = float(lines[0].split()[2])
    rows = [line.split() for line in lines[2:7]]
    assert len(rows) == 5
    changes = [float(r[2]) for r in rows]
    assert [abs(c) for c in changes] == sorted((abs(c) for c in changes), reverse=True)
    for layer, head, change in [(int(r[0]), int(r[1]), float(r[2])) for r in rows[:2]]:
        assert cosine_with_head_removed(layer, head) - clean == pytest.approx(change, abs=2e-4)
    image = imread(tmp_path / "heads.png")
    assert image.shape[0] > 200 and image.shape[1] > 400
    rgb = image[..., :3]
    assert float(np.abs(rgb - rgb.mean(axis=(0, 1))).max()) > 0.3  # not a blank picture


def test_heads_mean_mode_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tiny_checkpoint(tmp_path / "bert", layers=2, heads=4)
    assert main(["heads", A, B, "--mode", "mean", "--top", "3", "--model",
                 str(tmp_path / "bert"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "mean ablation" in printed and len(printed.splitlines()) == 6
    assert main(["heads", A, "", "--out", str(tmp_path)]) == 2
    assert "TEXT_B is empty" in capsys.readouterr().err
    assert main(["heads", A, B, "--top", "0", "--out", str(tmp_path)]) == 2
    assert "--top must be at least 1" in capsys.readouterr().err
