"""handformer.viz heat maps: PNG files, sizes, not blank, tokens as tick labels, patterns."""

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.image import imread

from handformer import Encoder, EncoderLayer
from handformer.masks import strided_mask, window_mask
from handformer.viz import plot_attention, plot_heads, save_figure

TOKENS = ["[CLS]", "the", "animal", "didn", "'", "t", "cross", "the", "street", "because",
          "it", "was", "too", "tired", "[SEP]"]


@pytest.fixture(scope="module")
def attentions():
    torch.manual_seed(1)
    enc = Encoder(EncoderLayer(32, 4, 64, dropout=0.0), 3).eval()
    with torch.no_grad():
        return enc(torch.randn(1, len(TOKENS), 32) * 3, need_weights=True).attentions


def _png_ok(path, fig):
    img = imread(path)  # (rows, cols, RGBA) floats in [0, 1]
    w, h = fig.get_size_inches() * fig.dpi
    assert img.shape[:2] == (round(h), round(w))
    assert img[..., :3].std() > 0.1  # not blank: real contrast
    # many colours (a colour map), not only white background and black text
    rgb = np.rint(img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 50
    return img


def test_head_png_size_not_blank_and_tokens_as_labels(attentions, tmp_path):
    fig = plot_attention(attentions[2][0, 1], TOKENS, title="Layer 2, head 1")
    path = save_figure(fig, tmp_path / "head.png")
    assert path.is_file()
    _png_ok(path, fig)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    assert ax.get_title() == "Layer 2, head 1"
    assert len(fig.axes) == 2  # the heat map and its colour bar
    np.testing.assert_allclose(ax.images[0].get_array(), attentions[2][0, 1].numpy())
    assert not list(tmp_path.glob(".*tmp"))  # atomic write left no temp file


def test_seed_style_input_and_cross_attention_tokens(tmp_path):
    w = torch.rand(1, 3, 4)  # the seed's (1, L_q, L_k)
    fig = plot_attention(w, ["a", "b", "c"], key_tokens=["w", "x", "y", "z"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["w", "x", "y", "z"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["a", "b", "c"]


def test_pattern_panel_beside_the_weights(attentions, tmp_path):
    L = len(TOKENS)
    pattern = window_mask(L, L, 5)
    fig = plot_attention(attentions[0][0, 0] * pattern, TOKENS, pattern=pattern)
    _png_ok(save_figure(fig, tmp_path / "p.png"), fig)
    weights_ax, pattern_ax = fig.axes[0], fig.axes[1]
    np.testing.assert_array_equal(pattern_ax.images[0].get_array(), pattern.numpy())
    assert [t.get_text() for t in pattern_ax.get_xticklabels()] == TOKENS
    n = int(pattern.sum())
    assert f"{n} of {L * L} pairs" in pattern_ax.get_title()
    assert weights_ax.get_title() == "Attention weights"


def test_pattern_from_an_attention_kind():
    class Strided:
        def pattern(self, L_q, L_k):
            return strided_mask(L_q, L_k, 3, global_tokens=1)

    fig = plot_attention(torch.rand(8, 8), list("abcdefgh"), pattern=Strided())
    np.testing.assert_array_equal(fig.axes[1].images[0].get_array(),
                                  strided_mask(8, 8, 3, global_tokens=1).numpy())


def test_draw_into_given_axes_greys_blocked_cells():
    fig = Figure()
    ax = fig.add_subplot(1, 1, 1)
    pattern = window_mask(5, 5, 3)
    got = plot_attention(torch.rand(5, 5), list("abcde"), ax=ax, pattern=pattern, title="t")
    assert got is fig and len(fig.axes) == 1
    overlay = ax.images[1].get_array()  # (L, L, RGBA)
    assert np.all(overlay[..., 3][~pattern.numpy()] > 0.5)
    assert np.all(overlay[..., 3][pattern.numpy()] == 0)


def test_long_input_labels_every_kth_token():
    tokens = [f"t{i}" for i in range(200)]
    fig = plot_attention(torch.rand(200, 200), tokens)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == tokens[::4]


def test_model_view_grid(attentions, tmp_path):
    fig = plot_heads(attentions, TOKENS)
    _png_ok(save_figure(fig, tmp_path / "model.png"), fig)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
    assert ax.get_xlabel() == "head" and ax.get_ylabel() == "layer"
    mosaic = ax.images[0].get_array()
    L, gap = len(TOKENS), max(1, len(TOKENS) // 8)
    assert mosaic.shape == (3 * L + 2 * gap, 4 * L + 3 * gap)
    # the thumbnail of layer 1, head 2 is that head scaled to its maximum
    a = attentions[1][0, 2].numpy()
    r, c = 1 * (L + gap), 2 * (L + gap)
    np.testing.assert_allclose(mosaic[r:r + L, c:c + L], a / a.max(), rtol=1e-6)


def test_model_view_selection_and_pooling():
    x = [torch.rand(2, 3, 300, 300) for _ in range(4)]
    fig = plot_heads(x, [str(i) for i in range(300)], layers=[1, 3], heads=[2])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "3"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2"]
    mosaic = ax.images[0].get_array()
    assert mosaic.shape[1] == 75  # 300 max-pooled by 4
    pooled = x[1][0, 2].numpy().reshape(75, 4, 75, 4).max(axis=(1, 3))
    np.testing.assert_allclose(mosaic[:75, :75], pooled / pooled.max(), rtol=1e-6)


@pytest.mark.parametrize("call, exc, match", [
    (lambda a: plot_attention(a[0][0], TOKENS), ValueError, "draws one head, got 1 layer"),
    (lambda a: plot_attention(a[0][0, 0], TOKENS[:-1]), ValueError, "14 entries"),
    (lambda a: plot_attention(a[0][0, 0], "the animal"), TypeError, "sequence of strings"),
    (lambda a: plot_attention(a[0][0, 0], TOKENS, pattern=torch.ones(15, 15)), TypeError,
     "boolean"),
    (lambda a: plot_heads(a, TOKENS, layers=[3]), ValueError, r"layers must .* 0\.\.2"),
    (lambda a: plot_heads(a, TOKENS, heads=[]), ValueError, r"heads must .* 0\.\.3"),
])
def test_errors(attentions, call, exc, match):
    with pytest.raises(exc, match=match):
        call(attentions)


def test_save_figure_to_missing_folder_raises_oserror(tmp_path):
    fig = plot_attention(torch.rand(3, 3), list("abc"))
    with pytest.raises(OSError):
        save_figure(fig, tmp_path / "missing" / "x.png")


def test_missing_glyphs_give_one_warning(tmp_path):
    import warnings

    from handformer.viz.heatmap import MissingGlyphWarning

    tokens = ["a", "\ue000", "\ue001", "\ue000"]  # private-use characters: no font has them
    fig = plot_attention(torch.rand(4, 4), tokens)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_figure(fig, tmp_path / "x.png")
    assert [w.category for w in caught] == [MissingGlyphWarning]
    assert "2 character(s)" in str(caught[0].message)
    assert (tmp_path / "x.png").is_file()
