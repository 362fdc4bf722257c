"""Pictures of what :mod:`handformer.inspect` computes: rollout / flow, faithfulness, lenses.

* :func:`plot_rollout` - the rollout matrix and one output position's scores from raw
  attention, rollout and flow side by side (``rollout.png`` of ``handformer viz --rollout``);
* :func:`plot_faithfulness` - per-token scores of every method and their Spearman table;
* :func:`plot_logit_lens` - the logit lens grid: layers x positions, the top token and its
  probability;
* :func:`plot_similarity_lens` - cosine to the final embedding (and to a second sentence's)
  per layer.

Shape letters: ``L`` length, ``M`` methods, ``N`` layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure

from handformer.viz.data import check_tokens
from handformer.viz.heatmap import (
    _font_size,
    _new_figure,
    _side_inches,
    _with_fonts,
    set_column_labels,
)

__all__ = ["plot_rollout", "plot_faithfulness", "plot_logit_lens", "plot_similarity_lens"]


def _matrix(x: object, name: str) -> np.ndarray:
    """A ``(L, L)`` float array from a tensor/array, a leading batch of 1 dropped."""
    a = np.asarray(x.detach().cpu().double() if isinstance(x, torch.Tensor) else x,
                   dtype=np.float64)
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{name} must be one (L, L) matrix (a batch of 1 allowed), got "
                         f"shape {tuple(np.shape(x))}")
    return a


def _row(x: object, name: str, L: int) -> np.ndarray | None:
    if x is None:
        return None
    a = np.asarray(x.detach().cpu().double() if isinstance(x, torch.Tensor) else x,
                   dtype=np.float64).reshape(-1)
    if a.shape != (L,):
        raise ValueError(f"{name} must hold one score per token ({L}), got {a.size}")
    return a


def _scaled(a: np.ndarray) -> np.ndarray:
    peak = float(np.abs(a).max())
    return a / peak if peak > 0 else a


@_with_fonts
def plot_rollout(rollout: object, tokens: Sequence[str], *, row: int = 0,
                 raw: object = None, flow: object = None, title: str | None = None,
                 cmap: str = "viridis") -> Figure:
    """The rollout matrix, and output position ``row`` scored three ways.

    Args:
        rollout: ``(L, L)`` (or ``(1, L, L)``) from :func:`handformer.inspect.attention_rollout`.
        tokens: the ``L`` token strings.
        row: the output position of the bar panel (default 0, ``[CLS]``; -1 for the last).
        raw: optional ``(L,)`` raw attention of that row (e.g. last layer, heads averaged).
        flow: optional ``(L,)`` attention flow of that row.
        title: the figure title.
        cmap: a matplotlib colour map name.

    Returns:
        The :class:`~matplotlib.figure.Figure`.

    Raises:
        ValueError: for shapes that do not match the tokens or a row out of range.
    """
    R = _matrix(rollout, "rollout")
    L = R.shape[0]
    toks = check_tokens(tokens, L)
    if not -L <= row < L:
        raise ValueError(f"row {row} is out of range: valid rows are 0..{L - 1} (or -{L}..-1)")
    row %= L
    series = [("raw attention", _row(raw, "raw", L), "#9e9e9e"),
              ("rollout", R[row], "#3b6fb6"), ("flow", _row(flow, "flow", L), "#d9822b")]
    series = [s for s in series if s[1] is not None]
    side = _side_inches(L)
    fig = _new_figure(side * 2 + 1.5, side)
    heat, bars = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 1]})
    im = heat.imshow(R, cmap=cmap, vmin=0.0, vmax=max(float(R.max()), 1e-12),
                     interpolation="nearest")
    fs = _font_size(L)
    step = 1 if L <= 64 else int(np.ceil(L / 64))
    heat.set_xticks(range(0, L, step))
    set_column_labels(heat, toks[::step], fs)
    heat.set_yticks(range(0, L, step))
    heat.set_yticklabels(toks[::step], fontsize=fs)
    heat.set_xlabel("input token")
    heat.set_ylabel("output position (after the last layer)")
    heat.set_title("Attention rollout")
    fig.colorbar(im, ax=heat, fraction=0.046, pad=0.02, label="share of the input token")
    y = np.arange(L)
    width = 0.8 / len(series)
    for k, (name, values, colour) in enumerate(series):
        bars.barh(y + (k - (len(series) - 1) / 2) * width, _scaled(values), height=width,
                  color=colour, label=name)
    bars.set_yticks(range(0, L, step))
    bars.set_yticklabels(toks[::step], fontsize=fs)
    bars.invert_yaxis()
    bars.set_xlabel("score, each method scaled to its maximum")
    bars.set_title(f"Output position {row} ({toks[row]}): where it comes from")
    bars.legend(loc="lower right", fontsize=9)
    fig.suptitle(title or f"Rollout over {L} tokens", fontsize=11)
    return fig


@_with_fonts
def plot_faithfulness(result: object, *, title: str | None = None) -> Figure:
    """Per-token scores of each method (each row scaled to its maximum) and the Spearman table.

    Args:
        result: a :class:`handformer.inspect.Faithfulness`.
        title: the figure title.

    Returns:
        The :class:`~matplotlib.figure.Figure`.
    """
    scores = result.scores.detach().cpu().double().numpy()  # (M, L)
    corr = result.correlation.detach().cpu().double().numpy()  # (M, M)
    M, L = scores.shape
    fig = _new_figure(min(max(0.35 * L + 3.0, 6.0), 14.0) + 4.5, max(3.2, 0.5 * M + 2.4))
    strip, table = fig.subplots(1, 2, gridspec_kw={"width_ratios": [max(L / 4, 2.0), 1.6]})
    shown = np.full((M, L), np.nan)  # tokens left out of the correlation: grey
    shown[:, result.positions] = np.stack([_scaled(s) for s in scores[:, result.positions]])
    strip.imshow(shown, cmap=matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd"),
                 vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    strip.set_yticks(range(M))
    strip.set_yticklabels(result.methods)
    strip.set_xticks(range(L))
    set_column_labels(strip, result.tokens, _font_size(L))
    strip.set_title(f"Token scores ({result.row} row; ablation: {result.ablation}), each "
                    "scaled to its maximum; grey: not ranked", fontsize=10)
    im = table.imshow(corr, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    for a in range(M):
        for b in range(M):
            text = "n/a" if np.isnan(corr[a, b]) else f"{corr[a, b]:.2f}"
            table.text(b, a, text, ha="center", va="center", fontsize=9,
                       color="white" if abs(np.nan_to_num(corr[a, b])) > 0.6 else "black")
    table.set_xticks(range(M))
    table.set_xticklabels(result.methods, rotation=45, ha="right", fontsize=9)
    table.set_yticks(range(M))
    table.set_yticklabels(result.methods, fontsize=9)
    table.set_title(f"Spearman over {len(result.positions)} tokens", fontsize=10)
    fig.colorbar(im, ax=table, fraction=0.046, pad=0.04)
    fig.suptitle(title or "How far to trust an attention picture", fontsize=11)
    return fig


@_with_fonts
def plot_logit_lens(lens: object, tokens: Sequence[str],
                    decode: Callable[[int], str] | Sequence[str], *, batch_index: int = 0,
                    title: str | None = None) -> Figure:
    """The logit lens grid: one row per layer, one column per position, the top token
    written in each cell and coloured by its probability.

    Args:
        lens: a :class:`handformer.inspect.LogitLens`.
        tokens: the input tokens (column labels).
        decode: token id -> text, a function (e.g. ``lambda i: tokenizer.decode([i])``) or a
            list indexed by id.
        batch_index: which input of the batch to draw.
        title: the figure title.

    Returns:
        The :class:`~matplotlib.figure.Figure`.

    Raises:
        ValueError: for a token count that does not match or a batch index out of range.
    """
    ids, probs = lens.top_ids, lens.top_probs  # (N', B, L, K)
    if not 0 <= batch_index < ids.shape[1]:
        raise ValueError(f"batch_index={batch_index} is out of range: the lens holds "
                         f"{ids.shape[1]} input(s)")
    N, L = ids.shape[0], ids.shape[2]
    toks = check_tokens(tokens, L)
    name = decode.__getitem__ if not callable(decode) else decode
    top = probs[:, batch_index, :, 0].detach().cpu().float().numpy()  # (N', L)
    fig = _new_figure(min(max(0.9 * L + 2.0, 5.0), 24.0), max(0.45 * N + 1.8, 3.0))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(top, cmap="Blues", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    fs = min(9.0, max(5.0, 110.0 / max(L, 1)))
    for n in range(N):
        for j in range(L):
            text = name(int(ids[n, batch_index, j, 0])).replace("\n", "\u21b5")
            ax.text(j, n, text[:10], ha="center", va="center", fontsize=fs,
                    color="white" if top[n, j] > 0.6 else "black")
    ax.set_xticks(range(L))
    set_column_labels(ax, toks, fs + 1)
    ax.set_yticks(range(N))
    ax.set_yticklabels([f"layer {i}" for i in lens.layers])
    ax.set_xlabel("input position (each cell: the most likely NEXT token, read at that layer)")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02, label="probability of the top token")
    fig.suptitle(title or "Logit lens", fontsize=11)
    return fig


@_with_fonts
def plot_similarity_lens(lens: object, *, text: str | None = None, other: str | None = None,
                         title: str | None = None) -> Figure:
    """Cosine of each depth's sentence embedding to the final one (and to ``other``'s).

    Args:
        lens: a :class:`handformer.inspect.SimilarityLens`.
        text, other: the two sentences, for the legend.
        title: the figure title.

    Returns:
        The :class:`~matplotlib.figure.Figure`.
    """
    x = np.arange(len(lens.labels))
    fig = _new_figure(7.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)

    def short(s: str | None, default: str) -> str:
        return default if s is None else (s if len(s) <= 40 else s[:37] + "...")

    ax.plot(x, lens.to_final.numpy(), marker="o", color="#3b6fb6",
            label=f"{short(text, 'the text')} vs its final embedding")
    if lens.to_other is not None:
        ax.plot(x, lens.to_other.numpy(), marker="s", color="#d9822b",
                label=f"vs {short(other, 'the second text')} at the same depth")
    ax.set_xticks(x)
    ax.set_xticklabels(lens.labels, rotation=30, ha="right")
    ax.set_ylabel("cosine similarity")
    ax.set_ylim(min(0.0, float(np.nanmin(lens.to_final.numpy())) - 0.05), 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="lower right")
    fig.suptitle(title or "Similarity lens: the sentence embedding at every depth",
                 fontsize=11)
    return fig
