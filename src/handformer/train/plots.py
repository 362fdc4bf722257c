"""End-of-run pictures: the loss curve (from ``metrics.jsonl``) and the model's attention.

Both are drawn with the visualisation API (:mod:`handformer.viz`) on the Agg canvas and
written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

__all__ = ["read_metrics", "plot_loss_curve", "plot_model_attention"]


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (one JSON object per line; a torn last line is
    skipped)."""
    records = []
    if not Path(path).is_file():
        return records
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_loss_curve(metrics_path: Path, out: Path) -> Path:
    """Training loss per logged step, evaluation loss (and accuracy) per evaluation.

    Returns:
        ``out`` (a PNG).
    """
    from handformer.viz.heatmap import save_figure

    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", ms=3,
                label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    if any(r["loss"] > 0 for r in train + evals):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any("accuracy" in r for r in evals):
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "s--", ms=3,
                 color="tab:green", label="eval exact match")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("exact-match accuracy")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle("Training curve")
    fig.tight_layout()
    return save_figure(fig, out)


def pick_head(attentions: tuple[torch.Tensor, ...], rows: slice, keys: slice
              ) -> tuple[int, int, float]:
    """The ``(layer, head, score)`` whose queries ``rows`` put the most weight on ``keys``
    (for the synthetic tasks: the target positions reading the input), or, with all keys,
    the most focused head (largest mean row maximum).

    ``attentions``: one ``(1, H, L, L)`` tensor per layer.
    """
    best = (0, 0, -1.0)
    everything = keys == slice(None)
    for n, weights in enumerate(attentions):
        w = weights[0, :, rows]  # (H, R, L)
        score = w.max(-1).values.mean(-1) if everything else w[..., keys].sum(-1).mean(-1)
        h = int(score.argmax())
        if float(score[h]) > best[2]:
            best = (n, h, float(score[h]))
    return best


@torch.no_grad()
def plot_model_attention(model: nn.Module, ids: list[int], tokens: list[str], out: Path,
                         *, title: str, head_out: Path | None = None,
                         rows: slice = slice(None), keys: slice = slice(None)) -> Path:
    """Every head of every layer of ``model`` on one input (the model view), and optionally
    the head chosen by :func:`pick_head` on its own, with token labels.

    Args:
        model: a model whose forward takes ``(1, L)`` ids and ``need_weights=True`` and returns
            an output with ``.attentions``.
        ids: the input token ids.
        tokens: one label per id.
        out: the PNG path of the model view.
        title: the figure title.
        head_out: the PNG path of the one-head picture (None: not drawn).
        rows, keys: what :func:`pick_head` looks at.

    Returns:
        ``out``.
    """
    from handformer.viz.heatmap import plot_attention, plot_heads, save_figure

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    output = model(torch.tensor([ids], device=device), need_weights=True)
    model.train(was_training)
    save_figure(plot_heads(output.attentions, tokens, title=title), out)
    if head_out is not None:
        layer, head, _ = pick_head(output.attentions, rows, keys)
        what = "reading the input" if keys != slice(None) else "the most focused head"
        fig = plot_attention(output.attentions[layer][0, head], tokens,
                             title=f"Layer {layer}, head {head} ({what})")
        save_figure(fig, head_out)
    return out
