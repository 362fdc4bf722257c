"""Pictures of what :mod:`handformer.inspect` finds inside a causal LM.

* :func:`plot_logit_attribution` - direct logit attribution: a bar per component
  (``decompose_resid``'s ``embed``, ``0_attn_out``, ``0_mlp_out``, ...) or, for per-head
  labels ``L{l}H{h}`` (``stack_head_results``), a layer x head heat map, with the
  ``remainder`` and ``bias`` terms and the total written beside it;
* :func:`plot_head_scores` - a layer x head map of scores in [0, 1] (``detect_heads``).

Shape letters: ``C`` components, ``N`` layers, ``H`` heads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from handformer.viz.heatmap import _colormap, _new_figure, _with_fonts

__all__ = ["plot_logit_attribution", "plot_head_scores", "head_grid"]

_HEAD = re.compile(r"L(\d+)H(\d+)")


def _values(attrs: object, labels: Sequence[str]) -> np.ndarray:
    """``(C,)`` float64: the attributions, averaged over any batch / position dims."""
    a = np.asarray(attrs.detach().cpu().double() if isinstance(attrs, torch.Tensor) else attrs,
                   dtype=np.float64)
    if a.ndim == 0 or a.shape[0] != len(labels):
        raise ValueError(f"attrs must have one row per label ({len(labels)}), got shape "
                         f"{a.shape}")
    return a.reshape(a.shape[0], -1).mean(1)


def head_grid(values: np.ndarray, labels: Sequence[str]
              ) -> tuple[np.ndarray, dict[str, float]] | None:
    """The ``L{l}H{h}`` entries as an ``(N, H)`` grid (NaN where absent) and the other
    entries by label; None when no label names a head."""
    heads = {(int(m.group(1)), int(m.group(2))): float(v)
             for label, v in zip(labels, values, strict=True) if (m := _HEAD.fullmatch(label))}
    if not heads:
        return None
    N = max(layer for layer, _ in heads) + 1
    H = max(head for _, head in heads) + 1
    grid = np.full((N, H), np.nan)
    for (layer, head), v in heads.items():
        grid[layer, head] = v
    rest = {label: float(v) for label, v in zip(labels, values, strict=True)
            if not _HEAD.fullmatch(label)}
    return grid, rest


@_with_fonts
def plot_logit_attribution(attrs: object, labels: Sequence[str], *, title: str = "",
                           what: str = "logit") -> Figure:
    """Direct logit attribution: per component (bars) or per head (layer x head).

    Args:
        attrs: ``(C,)`` or ``(C, ...)`` attributions (e.g. ``cache.logit_attrs(...)``; other
            dims are averaged), one row per label.
        labels: the labels (``return_labels=True``; ``"bias"`` for the bias term).
        title: figure title.
        what: what is attributed, for the axis label (``"logit"``, ``"logit difference"``).

    Returns:
        The figure.

    Raises:
        ValueError: if ``attrs`` does not have one row per label.
    """
    values = _values(attrs, labels)
    total = float(values.sum())
    grid = head_grid(values, labels)
    if grid is None:
        fig = _new_figure(max(4.0, 0.32 * len(labels) + 1.5), 3.4)
        ax = fig.add_subplot()
        colors = ["#b2182b" if v > 0 else "#2166ac" for v in values]
        ax.bar(range(len(values)), values, color=colors)
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_ylabel(f"share of the {what}")
    else:
        data, rest = grid
        N, H = data.shape
        fig = _new_figure(max(4.0, 1.6 + 0.45 * H), max(3.0, 1.4 + 0.35 * N))  # room for a title
        ax = fig.add_subplot()
        bound = float(np.nanmax(np.abs(data))) or 1.0
        image = ax.imshow(data, cmap=_colormap("RdBu_r"), vmin=-bound, vmax=bound,
                          aspect="auto", interpolation="nearest")
        ax.set_xticks(range(H), [str(h) for h in range(H)], fontsize=7)
        ax.set_yticks(range(N), [str(n) for n in range(N)], fontsize=7)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, label=f"share of the {what}", shrink=0.9)
        if rest:
            ax.text(0.0, -0.12, "  ".join(f"{k} {v:+.2f}" for k, v in rest.items()),
                    transform=ax.transAxes, fontsize=7, va="top")
    ax.set_title(f"{title}{' - ' if title else ''}{what} {total:+.2f} in all", fontsize=9)
    return fig


@_with_fonts
def plot_head_scores(scores: object, *, title: str = "", label: str = "score",
                     top: int = 5) -> Figure:
    """A layer x head map of scores in [0, 1], the ``top`` heads written in.

    Args:
        scores: ``(N, H)`` (e.g. ``detect_heads``).
        title: figure title.
        label: colour-bar label.
        top: how many of the highest scores to write in.

    Returns:
        The figure.

    Raises:
        ValueError: if ``scores`` is not 2-D.
    """
    data = np.asarray(scores.detach().cpu().double() if isinstance(scores, torch.Tensor)
                      else scores, dtype=np.float64)
    if data.ndim != 2:
        raise ValueError(f"scores must be (num_layers, num_heads), got shape {data.shape}")
    N, H = data.shape
    fig = _new_figure(max(4.0, 1.6 + 0.45 * H), max(3.0, 1.2 + 0.35 * N))  # room for a title
    ax = fig.add_subplot()
    image = ax.imshow(data, cmap=_colormap("viridis"), vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(H), [str(h) for h in range(H)], fontsize=7)
    ax.set_yticks(range(N), [str(n) for n in range(N)], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    for i in np.argsort(-np.nan_to_num(data, nan=-1.0), axis=None)[:top]:
        n, h = divmod(int(i), H)
        ax.text(h, n, f"{data[n, h]:.2f}", ha="center", va="center", fontsize=6,
                color="black" if data[n, h] > 0.6 else "white")
    fig.colorbar(image, ax=ax, label=label, shrink=0.9)
    if title:
        ax.set_title(title, fontsize=9)
    return fig
