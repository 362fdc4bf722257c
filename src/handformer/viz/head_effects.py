"""A (layer x head) heat map of each head's effect when ablated (``heads.png``).

Shape letters: ``N`` layers, ``H`` heads.
"""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from torch import Tensor

from handformer.viz.heatmap import _colormap, _new_figure, _with_fonts

__all__ = ["plot_head_effects"]


@_with_fonts
def plot_head_effects(effects: Tensor | np.ndarray, *, title: str = "",
                      label: str = "change when the head is ablated", top: int = 5,
                      ax: Axes | None = None) -> Figure:
    """Draw ``effects`` ``(N, H)`` with a diverging colour map centred on 0; the ``top``
    heads with the largest absolute effect are outlined and labelled with their value.

    Args:
        effects: ``(N, H)`` numbers (NaN = not measured, drawn blank).
        title: figure title.
        label: colour-bar label.
        top: how many of the strongest heads to outline.
        ax: draw into these axes instead of a new figure.

    Returns:
        The figure.

    Raises:
        ValueError: if ``effects`` is not 2-D.
    """
    data = np.asarray(effects.detach().cpu() if isinstance(effects, Tensor) else effects,
                      dtype=np.float64)
    if data.ndim != 2:
        raise ValueError(f"effects must be (num_layers, num_heads), got shape {data.shape}")
    N, H = data.shape
    if ax is None:
        fig = _new_figure(1.2 + 0.55 * H, 1.2 + 0.5 * N)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    finite = np.nan_to_num(data, nan=0.0)
    bound = float(np.abs(finite).max()) or 1.0
    image = ax.imshow(data, cmap=_colormap("RdBu_r"), vmin=-bound, vmax=bound,
                      aspect="auto", interpolation="nearest")
    ax.set_xticks(range(H), [str(h) for h in range(H)])
    ax.set_yticks(range(N), [str(n) for n in range(N)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    for i in np.argsort(-np.abs(finite), axis=None)[:top]:
        n, h = divmod(int(i), H)
        ax.add_patch(_outline(h, n))
        ax.text(h, n, f"{data[n, h]:+.3f}", ha="center", va="center", fontsize=6.5,
                color="white" if abs(data[n, h]) > 0.6 * bound else "black")
    fig.colorbar(image, ax=ax, label=label, shrink=0.9)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def _outline(x: int, y: int):  # noqa: ANN202 - a matplotlib Rectangle
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.5)
