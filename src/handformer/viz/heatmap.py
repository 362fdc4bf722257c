"""Matplotlib heat maps: one head (tokens on both axes) and the model view (every head).

Figures are built with :class:`matplotlib.figure.Figure` on the Agg canvas, never through
``pyplot``: no GUI backend is touched, no global figure list grows, and it works headless.
In a notebook the returned figure displays itself.

Shape letters: ``N`` layers, ``H`` heads, ``L_q`` queries, ``L_k`` keys.
"""

from __future__ import annotations

import functools
import math
import os
import re
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.text import Text

from handformer.viz.data import as_attention_array, as_pattern, check_tokens
from handformer.viz.files import write_atomic
from handformer.viz.fonts import ZH_EXTRA, font_families, has_wide, upright_column_label

__all__ = ["plot_attention", "plot_heads", "save_figure", "MissingGlyphWarning",
           "set_column_labels"]

DPI = 100
# Blocked cells of a pattern: light grey; allowed: dark slate (readable in print too).
_PATTERN_CMAP = ListedColormap(["#eeeeee", "#3b4a6b"])


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _side_inches(n: int) -> float:
    """Edge of one heat-map panel for ``n`` tokens: readable labels, bounded size."""
    return float(min(max(0.32 * n + 2.5, 5.0), 12.0))


def _label_step(n: int) -> int:
    """Label every token up to 64, then every k-th so labels stay legible."""
    return 1 if n <= 64 else math.ceil(n / 64)


def _font_size(n: int) -> float:
    return float(min(max(14.0 - n / 6.0, 6.0), 12.0))


def _token_axes(ax: Axes, rows: Sequence[str], cols: Sequence[str]) -> None:
    step_r, step_c = _label_step(len(rows)), _label_step(len(cols))
    fs = _font_size(max(len(rows), len(cols)))
    ax.set_xticks(range(0, len(cols), step_c))
    set_column_labels(ax, cols[::step_c], fs)
    ax.set_yticks(range(0, len(rows), step_r))
    ax.set_yticklabels(rows[::step_r], fontsize=fs)
    ax.set_xlabel("Key (attended to)")
    ax.set_ylabel("Query (attending)")


def set_column_labels(ax: Axes, labels: Sequence[str], fontsize: float) -> None:
    """Token labels under the columns: turned sideways, except labels with Chinese, Japanese
    or Korean characters, which are written top to bottom with upright characters."""
    ax.set_xticklabels([upright_column_label(t) if has_wide(t) else t for t in labels],
                       rotation=90, fontsize=fontsize)
    for text, label in zip(ax.get_xticklabels(), labels, strict=True):
        if has_wide(label):
            text.set_rotation(0)
            text.set_linespacing(1.0)


def fit_titles(fig: Figure, *, tries: int = 4, max_lines: int = 3) -> Figure:
    """Wrap the figure's titles (its suptitle, each axes' title) onto more lines until each
    lies inside the figure, and an axes' title not far over its neighbours: a long model name
    and attention kind would otherwise be cut at the figure's edges (a title is centred over
    its axes, which may sit off-centre). A title that would need more than ``max_lines``
    lines is shortened, ending in "…" (more lines would squeeze a small figure's axes away).

    Returns:
        ``fig``.
    """
    original: dict[int, str] = {}  # id(text) -> its text before wrapping
    chars: dict[int, int] = {}  # id(text) -> the line length it is wrapped at now
    for _ in range(tries):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig.draw_without_rendering()  # lays the figure out: titles get their final place
        # matplotlib warns of a missing glyph once per text: keep them for save_figure
        missing = getattr(fig, "_hf_missing_glyphs", [])
        fig._hf_missing_glyphs = missing + [c for c in _missing_glyphs(caught)
                                            if c not in missing]
        renderer = fig.canvas.get_renderer()
        width = fig.bbox.width
        changed = False
        for text, ax in _titles(fig):
            box = text.get_window_extent(renderer)
            centre = (box.x0 + box.x1) / 2
            room = 2 * min(centre, width - centre) * 0.96  # what fits centred where it is
            if ax is not None:  # an axes' title: not far over its neighbours either
                room = min(room, 1.3 * ax.bbox.width)
            if box.width == 0 or box.width <= room:
                continue
            key = id(text)
            if key not in original and text.get_fontsize() > 8:  # first: a smaller font
                text.set_fontsize(max(8.0, text.get_fontsize() * max(0.75, room / box.width)))
                original[key] = text.get_text()
                changed = True
                continue
            source = original.setdefault(key, text.get_text())
            longest = max(len(line) for line in text.get_text().split("\n"))
            chars[key] = max(8, min(int(longest * room / box.width), longest - 1))
            lines = [part for line in source.split("\n")
                     for part in textwrap.wrap(line, chars[key]) or [""]]
            if len(lines) > max_lines:
                lines = lines[:max_lines]
                lines[-1] = lines[-1][:chars[key] - 1].rstrip() + "\u2026"
            text.set_text("\n".join(lines))
            changed = True
        if not changed:
            break
    return fig


def _titles(fig: Figure) -> list[tuple[Text, Axes | None]]:
    """The figure's non-empty titles, each with its axes (None for the suptitle)."""
    found = [(fig._suptitle, None)] if fig._suptitle is not None else []
    for ax in fig.axes:
        found += [(t, ax) for t in (ax.title, getattr(ax, "_left_title", None),
                                    getattr(ax, "_right_title", None)) if t is not None]
    return [(t, ax) for t, ax in found if t.get_text()]


def _one_head(weights: object) -> np.ndarray:
    x = as_attention_array(weights)  # (N, H, L_q, L_k)
    if x.shape[0] * x.shape[1] != 1:
        raise ValueError(
            f"plot_attention draws one head, got {x.shape[0]} layer(s) x {x.shape[1]} head(s) "
            f"(shape {tuple(x.shape)}); pass one head's (L_q, L_k) weights such as "
            "out.attentions[layer][0, head], or use plot_heads"
        )
    return x[0, 0]  # (L_q, L_k)


def _with_fonts(fn):  # noqa: ANN001, ANN202 - keeps the wrapped signature
    """Create every text of the figure with the fonts of :func:`~handformer.viz.fonts.font_families`
    (DejaVu Sans, then a CJK font)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with matplotlib.rc_context({"font.family": list(font_families())}):
            return fn(*args, **kwargs)

    return wrapper


@_with_fonts
def plot_attention(weights: object, tokens: Sequence[str], *, ax: Axes | None = None,
                   title: str | None = None, pattern: object = None,
                   key_tokens: Sequence[str] | None = None, cmap: str = "viridis") -> Figure:
    """Heat map of one head: queries as rows, keys as columns, tokens as tick labels.

    Args:
        weights: one head's ``(L_q, L_k)`` weights (leading dimensions of size 1 allowed), a
            tensor or numpy array.
        tokens: the query tokens (and key tokens unless ``key_tokens`` is given).
        ax: draw into these axes (no colour bar, no pattern panel) instead of a new figure.
        title: the title, e.g. ``"Layer 3, head 5"``.
        pattern: the keys each query may reach, shown beside the weights: a boolean
            ``(L_q, L_k)`` tensor/array (True = may attend) or an attention kind such as
            ``LocalAttention(3)``. With ``ax`` given, blocked cells are greyed out instead.
        key_tokens: key tokens for cross-attention (defaults to ``tokens``).
        cmap: a matplotlib colour map name.

    Returns:
        The :class:`~matplotlib.figure.Figure` (``ax.figure`` when ``ax`` is given).

    Raises:
        ValueError: if the weights are not one head, or counts or shapes do not match.
        TypeError: for tokens that are not strings or a non-boolean pattern.
    """
    w = _one_head(weights)  # (L_q, L_k)
    L_q, L_k = w.shape
    rows = check_tokens(tokens, L_q)
    cols = rows if key_tokens is None else check_tokens(key_tokens, L_k, "key_tokens")
    allowed = as_pattern(pattern, L_q, L_k)  # (L_q, L_k) or None
    vmin, vmax = min(0.0, float(w.min())), float(w.max())
    vmax = vmax if vmax > vmin else vmin + 1.0

    if ax is not None:
        fig = ax.figure
        ax.imshow(w, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        if allowed is not None:
            grey = np.zeros((L_q, L_k, 4), dtype=np.float32)  # (L_q, L_k, RGBA)
            grey[~allowed] = (0.93, 0.93, 0.93, 0.85)
            ax.imshow(grey, interpolation="nearest")
        _token_axes(ax, rows, cols)
        if title:
            ax.set_title(title)
        return fig

    side = _side_inches(max(L_q, L_k))
    panels = 1 if allowed is None else 2
    fig = _new_figure(side * panels + 1.2 * panels, side)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    im = axes[0].imshow(w, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    _token_axes(axes[0], rows, cols)
    axes[0].set_title(title or "Attention weights")
    fig.colorbar(im, ax=axes[0], fraction=0.046, pad=0.02, label="attention weight")
    if allowed is not None:
        axes[1].imshow(allowed, cmap=_PATTERN_CMAP, vmin=0, vmax=1, interpolation="nearest")
        _token_axes(axes[1], rows, cols)
        n_allowed = int(allowed.sum())
        axes[1].set_title(f"Keys each query may reach: {n_allowed} of {L_q * L_k} pairs "
                          f"({n_allowed / (L_q * L_k):.0%})")
    return fit_titles(fig)


def _pool(w: np.ndarray, size: int) -> np.ndarray:
    """Max-pool an ``(L_q, L_k)`` map so its longer side is at most ``size`` (peaks survive)."""
    f = math.ceil(max(w.shape) / size)
    if f <= 1:
        return w
    L_q, L_k = w.shape
    pad = np.zeros((math.ceil(L_q / f) * f, math.ceil(L_k / f) * f), dtype=w.dtype)
    pad[:L_q, :L_k] = w
    R, C = pad.shape[0] // f, pad.shape[1] // f
    return pad.reshape(R, f, C, f).max(axis=(1, 3))  # (R*f, C*f) -> (R, f, C, f) -> (R, C)


def _pick(name: str, chosen: Sequence[int] | None, count: int) -> list[int]:
    if chosen is None:
        return list(range(count))
    out = [int(i) for i in chosen]
    bad = [i for i in out if not 0 <= i < count]
    if not out or bad:
        raise ValueError(f"{name} must be a non-empty list of indices in 0..{count - 1}, "
                         f"got {list(chosen)}")
    return out


@_with_fonts
def plot_heads(attentions: object, tokens: Sequence[str], *,
               layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
               title: str | None = None, cmap: str = "viridis") -> Figure:
    """The model view: one thumbnail per layer (rows) and head (columns).

    Each thumbnail is scaled to its own maximum, so patterns (diagonals, "attend to [SEP]",
    "attend to the previous token") are comparable between heads. Long inputs are max-pooled
    to at most 96 cells per side.

    Args:
        attentions: anything :func:`handformer.viz.data.as_attention_array` accepts, e.g. a
            model output's ``.attentions``.
        tokens: one string per query position (checked against the weights).
        layers: layer indices to show (default all).
        heads: head indices to show (default all).
        title: the figure title.
        cmap: a matplotlib colour map name.

    Returns:
        The :class:`~matplotlib.figure.Figure`.

    Raises:
        ValueError: for indices out of range or a token count that does not match.
    """
    x = as_attention_array(attentions)  # (N, H, L_q, L_k)
    N, H, L_q, L_k = x.shape
    check_tokens(tokens, L_q)
    rows, cols = _pick("layers", layers, N), _pick("heads", heads, H)
    thumbs = [[_pool(x[n, h], 96) for h in cols] for n in rows]
    R, C = thumbs[0][0].shape
    gap = max(1, max(R, C) // 8)
    mosaic = np.full((len(rows) * (R + gap) - gap, len(cols) * (C + gap) - gap), np.nan)
    for a, row in enumerate(thumbs):
        for b, t in enumerate(row):
            peak = float(t.max())
            mosaic[a * (R + gap):a * (R + gap) + R, b * (C + gap):b * (C + gap) + C] = (
                t / peak if peak > 0 else t)
    cell = 0.75 if len(cols) > 8 else 1.1
    fig = _new_figure(min(max(cell * len(cols) + 1.6, 4.0), 20.0),
                      min(max(cell * len(rows) * R / C + 1.4, 3.0), 20.0))
    ax = fig.add_subplot(1, 1, 1)
    colours = _colormap(cmap).with_extremes(bad="white")
    ax.imshow(mosaic, cmap=colours, vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks([b * (C + gap) + (C - 1) / 2 for b in range(len(cols))])
    ax.set_xticklabels([str(h) for h in cols], fontsize=9)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("head")
    ax.set_yticks([a * (R + gap) + (R - 1) / 2 for a in range(len(rows))])
    ax.set_yticklabels([str(n) for n in rows], fontsize=9)
    ax.set_ylabel("layer")
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.suptitle(title or f"Every head, each scaled to its maximum ({L_q} tokens)", fontsize=11)
    return fit_titles(fig)


def _colormap(name: str):  # noqa: ANN202 - matplotlib Colormap
    return matplotlib.colormaps[name]


class MissingGlyphWarning(UserWarning):
    """Some token characters have no glyph in the installed fonts (drawn as boxes)."""


# File extension -> matplotlib format name (what save_figure writes).
FIGURE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf", ".jpg": "jpeg", ".jpeg": "jpeg"}


def figure_format(path: str | os.PathLike[str]) -> str:
    """The format :func:`save_figure` writes for ``path``, from its extension.

    Raises:
        ValueError: for a missing or other extension (the message lists the accepted ones).
    """
    suffix = Path(path).suffix.lower()
    if suffix not in FIGURE_FORMATS:
        raise ValueError(f"cannot tell the image format of {Path(path).name!r} from its "
                         f"extension {suffix or '(none)'}: save_figure writes "
                         f"{', '.join(FIGURE_FORMATS)}; name the file e.g. attention.png")
    return FIGURE_FORMATS[suffix]


def _missing_glyphs(caught: list[warnings.WarningMessage]) -> list[str]:
    """The characters of matplotlib's "Glyph ... missing from font" warnings among
    ``caught``, each once; the other warnings are issued again."""
    missing: list[str] = []
    for w in caught:
        m = re.search(r"Glyph \d+ \((.*?)\) missing from font", str(w.message))
        if m is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        try:
            char = m.group(1).encode("ascii", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError:
            char = m.group(1)
        if char not in missing:
            missing.append(char)
    return missing


def save_figure(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Save ``fig`` atomically at the figure's own size and DPI; returns the path.

    The format follows the extension: ``.png``, ``.svg``, ``.pdf``, ``.jpg`` / ``.jpeg``
    (JPEG on a white background, as JPEG has no transparency). Titles that would reach past
    the figure's edges are wrapped first (:func:`fit_titles`). Characters no installed font
    can draw (e.g. Chinese without a CJK font) give one :class:`MissingGlyphWarning` instead
    of matplotlib's warning per glyph.

    Args:
        fig: the matplotlib figure.
        path: where to write it; the extension picks the format.

    Raises:
        ValueError: for another extension (nothing is written).
        OSError: if the file cannot be written (the message names it and its folder).
    """
    fmt = figure_format(path)
    extra = {"facecolor": "white"} if fmt == "jpeg" else {}
    fit_titles(fig)  # a title longer than the figure is wrapped, not cut at its edges
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=fig.dpi, **extra))
    missing = list(getattr(fig, "_hf_missing_glyphs", []))  # found while fitting the titles
    missing += [c for c in _missing_glyphs(caught) if c not in missing]
    if missing:
        warnings.warn(
            f"{len(missing)} character(s) of the tokens have no glyph in the installed fonts "
            f"(e.g. {missing[0]}) and show as boxes in {Path(path).name}; install a font "
            f"that has them (Chinese, Japanese, Korean: {ZH_EXTRA}). index.html uses the "
            "browser's fonts", MissingGlyphWarning, stacklevel=2)
    return written
