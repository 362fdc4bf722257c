"""Draw an attribution graph for a paper: positions across, layers up; PNG or SVG.

Token embeddings sit on the bottom row, each layer's features and error nodes on its row
(features as circles, errors as squares, spread within their position's column), the logits on
top. Edges are lines, blue for positive direct effects and red for negative, their width and
opacity by ``|weight|`` relative to the largest drawn. matplotlib is imported here only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from handformer.features.graph import AttributionGraph
from handformer.features.influence import Pruned

__all__ = ["draw_graph"]

_FORMATS = (".png", ".svg", ".pdf")


def _layout(graph: AttributionGraph, keep: list[int]) -> dict[int, tuple[float, float]]:
    """Node index -> (x, y): x the position (spread in its cell), y the layer row."""
    L, n_f = graph.n_positions, graph.n_features
    cells: dict[tuple[int, int], list[int]] = {}
    for i in keep:
        if i < n_f:
            layer, pos, _ = graph.features[i].tolist()
            cell = (pos, layer + 1)
        elif i < graph.errors.stop:
            layer, pos = divmod(i - graph.errors.start, L)
            cell = (pos, layer + 1)
        elif i < graph.tokens.stop:
            cell = (i - graph.tokens.start, 0)
        else:
            cell = (graph.logit_position, graph.n_layers + 1)
        cells.setdefault(cell, []).append(i)
    xy = {}
    for (pos, row), members in cells.items():
        for k, i in enumerate(members):
            xy[i] = (pos + (k + 1) / (len(members) + 1) - 0.5, float(row))
    return xy


def draw_graph(graph: AttributionGraph, path: str | os.PathLike, *,
               pruned: Pruned | None = None, prompt_tokens: list[str] | None = None,
               title: str | None = None) -> Path:
    """Draw ``graph`` (or what ``pruned`` keeps of it) to a PNG, SVG or PDF file.

    Args:
        graph: the graph.
        path: the file; its suffix picks the format (``.png``, ``.svg``, ``.pdf``).
        pruned: draw only the nodes and edges it keeps (default: the nodes with an edge).
        prompt_tokens: the x-axis labels (default: the token ids).
        title: the figure's title.

    Returns:
        The path written (a temporary file renamed into place).

    Raises:
        ValueError: for another suffix, prompt_tokens of the wrong length.
    """
    import matplotlib  # noqa: PLC0415 - drawing only here: the package does not need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.collections import LineCollection  # noqa: PLC0415
    from matplotlib.colors import to_rgba  # noqa: PLC0415

    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise ValueError(f"path must end in one of {list(_FORMATS)}, got {str(path)!r}")
    L = graph.n_positions
    tokens = prompt_tokens if prompt_tokens is not None else [str(int(t)) for t in
                                                              graph.input_ids]
    if len(tokens) != L:
        raise ValueError(f"prompt_tokens has {len(tokens)} entries, the graph {L} positions")
    A = graph.adjacency
    edges = pruned.edge_mask if pruned is not None else A != 0
    nodes = pruned.node_mask if pruned is not None else edges.any(0) | edges.any(1)
    keep = nodes.nonzero().flatten().tolist()
    xy = _layout(graph, keep)
    fig, ax = plt.subplots(figsize=(max(6.0, L * 0.9), max(4.0, (graph.n_layers + 2) * 0.45)))
    targets, sources = edges.nonzero(as_tuple=True)
    weights = A[targets, sources]
    top = float(weights.abs().max()) if len(weights) else 1.0
    segments, widths, colours = [], [], []
    for t, s, w in zip(targets.tolist(), sources.tolist(), weights.tolist(), strict=True):
        if t in xy and s in xy:
            strength = abs(w) / top
            segments.append([xy[s], xy[t]])
            widths.append(0.3 + 2.5 * strength)
            colours.append(to_rgba("tab:blue" if w > 0 else "tab:red", 0.15 + 0.7 * strength))
    # one artist for all edges and one per node kind (an artist each costs ~1 ms to draw)
    ax.add_collection(LineCollection(segments, linewidths=widths, colors=colours, zorder=1))
    kinds = [(range(graph.n_features), "o", "tab:orange"),
             (range(graph.errors.start, graph.errors.stop), "s", "0.6"),
             (range(graph.tokens.start, graph.tokens.stop), "^", "tab:green"),
             (range(graph.logits.start, graph.logits.stop), "D", "tab:purple")]
    for members, marker, colour in kinds:
        points = [xy[i] for i in members if i in xy]
        if points:
            ax.scatter([x for x, _ in points], [y for _, y in points], s=28, zorder=2,
                       marker=marker, color=colour)
    for i in range(graph.logits.start, graph.logits.stop):
        if i in xy:
            ax.annotate(graph.node_labels[i], xy[i], fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    ax.set_xticks(range(L), tokens, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(graph.n_layers + 2),
                  ["emb"] + [f"L{i}" for i in range(graph.n_layers)] + ["logit"], fontsize=8)
    ax.set_xlim(-0.6, L - 0.4)
    ax.set_title(title or f"attribution graph: {len(keep)} nodes, {len(weights)} edges "
                          f"(replacement {graph.replacement_score:.2f}, completeness "
                          f"{graph.completeness_score:.2f})", fontsize=9)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
