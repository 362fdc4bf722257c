"""CJK fonts in the PNG pictures: the ``zh`` extra's font is registered with matplotlib (even
behind a stale font cache), Chinese labels render without missing glyphs or ``findfont``
warnings, CJK column labels stay upright, and without any CJK font the note names the extra."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib import font_manager
from matplotlib.backends.backend_agg import FigureCanvasAgg

from handformer.viz import fonts
from handformer.viz.heatmap import MissingGlyphWarning, plot_attention, save_figure

ZH = ["动", "物", "没", "有", "过", "马", "路", "the", "动·1/2"]


@pytest.fixture
def fresh_families():
    """font_families() recomputed in the test; the font manager's list and lookups restored
    afterwards (after any change the test made to them)."""
    manager = font_manager.fontManager
    saved = manager.ttflist
    fonts.font_families.cache_clear()
    manager._findfont_cached.cache_clear()
    yield manager
    manager.ttflist = saved
    fonts.font_families.cache_clear()
    manager._findfont_cached.cache_clear()


def _render(tokens, tmp_path, caplog):
    """Save a heat map with ``tokens``; returns (path, warnings, findfont log lines)."""
    caplog.set_level(logging.DEBUG, logger="matplotlib.font_manager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = plot_attention(torch.rand(len(tokens), len(tokens)), tokens, title="注意力")
        path = save_figure(fig, tmp_path / "zh.png")
    found = [r.getMessage() for r in caplog.records if "findfont" in r.getMessage()
             and ("not found" in r.getMessage() or "Falling back" in r.getMessage())]
    return path, caught, found, fig


def test_packaged_font_is_found():
    path = fonts.packaged_cjk_font()
    assert path is not None, f"the zh extra is not installed: {fonts.ZH_EXTRA}"
    assert path.name == "NotoSansCJK-Regular.ttc" and path.stat().st_size > 10_000_000


def test_chinese_labels_render_with_the_packaged_font(tmp_path, caplog, fresh_families):
    assert fonts.font_families() == ("DejaVu Sans", fonts.PACKAGED_FAMILY)
    chosen = font_manager.findfont(font_manager.FontProperties(family=fonts.PACKAGED_FAMILY),
                                   fallback_to_default=False)
    # the extra's file, or the same font installed by the system (fonts-noto-cjk)
    assert Path(chosen).name == "NotoSansCJK-Regular.ttc"
    path, caught, findfont, _ = _render(ZH, tmp_path, caplog)
    assert not caught, [str(w.message) for w in caught]
    assert not findfont, findfont
    assert path.stat().st_size > 5000


def test_stale_font_cache_does_not_hide_the_font(tmp_path, caplog, fresh_families):
    # A font cache written before the extra was installed: the manager does not list it.
    packaged = str(fonts.packaged_cjk_font())
    fresh_families.ttflist = [f for f in fresh_families.ttflist if f.fname != packaged]
    assert fonts.font_families()[1] == fonts.PACKAGED_FAMILY  # registered again
    assert any(f.fname == packaged for f in font_manager.fontManager.ttflist)
    _, caught, findfont, _ = _render(ZH, tmp_path, caplog)
    assert not caught and not findfont


def test_without_a_cjk_font_the_note_names_the_extra(tmp_path, caplog, monkeypatch,
                                                     fresh_families):
    # No package and a cache that lists no CJK font: Chinese shows as boxes, and the one
    # warning says which extra brings the glyphs (the removed registration is what matters).
    monkeypatch.setattr(fonts, "packaged_cjk_font", lambda: None)
    cjk = set(fonts.SYSTEM_CJK_FAMILIES) | {f.name for f in fresh_families.ttflist
                                             if "CJK" in f.name}
    fresh_families.ttflist = [f for f in fresh_families.ttflist if f.name not in cjk]
    assert fonts.font_families() == ("DejaVu Sans",)
    _, caught, _, _ = _render(ZH, tmp_path, caplog)
    assert [w.category for w in caught] == [MissingGlyphWarning]
    assert fonts.ZH_EXTRA in str(caught[0].message)


def test_cjk_column_labels_are_upright(tmp_path, caplog, fresh_families):
    *_, fig = _render(ZH, tmp_path, caplog)
    ax = fig.axes[0]
    labels = {t.get_text(): t.get_rotation() for t in ax.get_xticklabels()}
    assert labels["动"] == 0 and labels["动\n·1/2"] == 0  # stacked top to bottom
    assert labels["the"] == 90  # Latin text is still turned sideways
    # Upright: the label is taller than wide, as a column of characters.
    FigureCanvasAgg(fig).draw()
    box = next(t for t in ax.get_xticklabels() if t.get_text() == "动\n·1/2"
               ).get_window_extent()
    assert box.height > box.width


@pytest.mark.parametrize(("label", "expected"), [
    ("动物", "动\n物"), ("动·1/2", "动\n·1/2"), ("abc", "abc"), ("a动b", "a\n动\nb"),
    ("␣过马", "␣\n过\n马"),
])
def test_upright_column_label(label, expected):
    assert fonts.upright_column_label(label) == expected


def test_cjk_glyphs_are_drawn_not_boxes(tmp_path, fresh_families):
    # The drawn label differs between two different characters (boxes would be identical).
    def ink(ch):
        fig = plot_attention(torch.ones(1, 1), [ch])
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        return np.asarray(canvas.buffer_rgba())[..., :3].astype(int)

    assert np.abs(ink("动") - ink("物")).sum() > 1000
