"""plot_logit_attribution and plot_head_scores draw what inspect computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

import handformer as hf
from handformer.inspect import detect_heads, run_with_cache
from handformer.viz import plot_head_scores, plot_logit_attribution, save_figure
from handformer.viz.llm_plots import head_grid


@pytest.fixture(scope="module")
def cache() -> object:
    torch.manual_seed(0)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=20, max_len=16, d_model=16, num_heads=4,
                                          num_layers=3, d_ff=32)).eval()
    return run_with_cache(model, torch.randint(0, 20, (2, 6)))[1]


def test_head_grid_places_each_head_and_keeps_the_rest() -> None:
    grid, rest = head_grid(np.array([1.0, 2.0, 3.0, 4.0]), ["L0H1", "L1H0", "remainder", "bias"])
    assert grid.shape == (2, 2) and grid[0, 1] == 1.0 and grid[1, 0] == 2.0
    assert np.isnan(grid[0, 0]) and rest == {"remainder": 3.0, "bias": 4.0}
    assert head_grid(np.array([1.0]), ["embed"]) is None


@pytest.mark.parametrize("how", ["layers", "heads"])
def test_plot_logit_attribution_writes_a_png(cache: object, how: str, tmp_path: Path) -> None:
    stack = (cache.decompose_resid(pos_slice=-1, return_labels=True) if how == "layers"
             else cache.stack_head_results(pos_slice=-1, incl_remainder=True,
                                           return_labels=True))
    attrs, labels = cache.logit_attrs(stack, 3, pos_slice=-1, incl_bias=True)
    fig = plot_logit_attribution(attrs, labels, title="test", what="logit")
    assert f"{float(attrs.mean(1).sum()):+.2f}" in fig.axes[0].get_title()
    image = imread(save_figure(fig, tmp_path / f"{how}.png"))
    assert image.shape[0] > 100 and image[..., :3].std() > 0.05
    with pytest.raises(ValueError, match="one row per label"):
        plot_logit_attribution(attrs, labels[:-1])


def test_plot_head_scores(cache: object, tmp_path: Path) -> None:
    scores = detect_heads(cache.model, torch.randint(0, 20, (2, 8)), "previous_token")
    fig = plot_head_scores(scores, title="previous-token heads")
    assert imread(save_figure(fig, tmp_path / "scores.png")).shape[0] > 100
    with pytest.raises(ValueError, match=r"scores must be \(num_layers, num_heads\)"):
        plot_head_scores(scores[0])


def test_viz_attribution_on_a_causal_folder(tmp_path: Path) -> None:
    import contextlib
    import io

    from handformer.cli import main
    from handformer.train.data import CharVocab
    from serve_util import causal_folder

    folder = causal_folder(tmp_path / "model")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["viz", "the cat sat", "--model", str(folder), "--attribution",
                     "--out", str(tmp_path / "o")]) == 0
    text = out.getvalue()
    for name in ("attribution.png", "attribution_heads.png"):
        assert (tmp_path / "o" / name).is_file() and f"{name}" in text
    line = next(x for x in text.splitlines() if x.startswith("next token"))
    model = hf.CausalLM.from_pretrained(folder)
    ids = torch.tensor([CharVocab.load(folder / "vocab.json").encode("the cat sat")])
    with torch.no_grad():
        top = model(ids).logits[0, -1].max()
    assert float(line.split("logit ")[1].split(",")[0]) == pytest.approx(float(top), abs=1e-3)


def test_viz_attribution_refuses_an_encoder(tmp_path: Path) -> None:
    import contextlib
    import io

    from handformer.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["viz", "a b", "--attribution", "--out", str(tmp_path)])
    assert code == 2 and "--attribution needs a causal language model" in err.getvalue()
