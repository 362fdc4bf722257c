"""An attribution graph as an interactive page: the data the view draws, and one
self-contained HTML file of it.

The view (``handformer/viz/graph_view.js``, also in ``handformer serve``'s page) reads
circuit-tracer's graph JSON (:func:`~handformer.features.graph_io.graph_to_json`) with a few
extras under ``"view"``:

- ``row_abs``: each node's whole input ``Σ_s |A[t, s]|``, so that the page's pruning — the
  same steps as :func:`~handformer.features.influence.prune`, in the browser, as the
  thresholds move — normalises by the full rows even where the page holds only the strongest
  edges (``max_edges``);
- ``n_layers``, ``scores`` (replacement, completeness), ``thresholds`` (the sliders' start),
  ``edges_total`` (the graph's non-zero edges), ``labels`` (per node: the logits' tokens);
- ``cards``: feature cards ``{"layer_feature": card}`` in the shape the server's
  ``/api/features/card`` answers (:func:`graph_feature_cards` makes them from a corpus).

The page lays nodes out as layers (rows: embeddings at the bottom, logits on top) × positions
(columns), draws edges blue / vermilion by sign, width and opacity by ``|weight|``, shows a
node's card on hover, lights the strongest paths through a clicked node, and groups
shift-clicked nodes into named supernodes (collapsed: one node whose edges are the sums of its
members' kept edges), which its *Save JSON* writes into ``qParams.supernodes``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handformer.features.graph import AttributionGraph
from handformer.features.graph_io import graph_to_json
from handformer.features.influence import Pruned, normalize_matrix

__all__ = ["graph_view_data", "save_graph_html", "render_graph_html", "graph_feature_cards",
           "MAX_VIEW_EDGES"]

MAX_VIEW_EDGES = 100_000  # edges a page holds (about 6 MB of JSON); the strongest are kept


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _check(node_threshold: float, edge_threshold: float, max_edges: int) -> None:
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    if isinstance(max_edges, bool) or not isinstance(max_edges, int) or max_edges < 1:
        raise ValueError(f"max_edges must be a positive int, got {max_edges!r}")


def graph_view_data(graph: AttributionGraph, *, prompt_tokens: Sequence[str] | None = None,
                    logit_tokens: Sequence[str] | None = None,
                    supernodes: list[list[str]] | None = None, slug: str = "handformer-graph",
                    cards: Mapping[str, dict[str, Any]] | None = None,
                    node_threshold: float = 0.8, edge_threshold: float = 0.98,
                    max_edges: int = MAX_VIEW_EDGES) -> dict[str, Any]:
    """The graph file the view draws: circuit-tracer's JSON (every node, every non-zero edge,
    or the ``max_edges`` carrying most influence) plus the ``"view"`` extras (module docs).

    Args:
        graph: the graph.
        prompt_tokens: the prompt's token strings (default: the graph's, else the ids).
        logit_tokens: one label per logit node (default: the token ids).
        supernodes: ``[[name, node_id, ...], ...]`` shown collapsed (default: the graph's).
        slug: the graph's name.
        cards: feature cards by ``"layer_feature"`` (:func:`graph_feature_cards`).
        node_threshold, edge_threshold: where the page's sliders start, in ``(0, 1]``.
        max_edges: the most edges the page holds.

    Returns:
        A JSON-ready dict.

    Raises:
        ValueError: for thresholds outside ``(0, 1]``, prompt or logit tokens of the wrong
            length, a supernode naming an unknown node.
    """
    _check(node_threshold, edge_threshold, max_edges)
    A = graph.adjacency
    n_logits = graph.logits.stop - graph.logits.start
    if logit_tokens is not None and len(logit_tokens) != n_logits:
        raise ValueError(f"logit_tokens has {len(logit_tokens)} entries, the graph "
                         f"{n_logits} logit nodes")
    nonzero = A != 0
    total = int(nonzero.sum())
    pruned = None
    if total > max_edges:  # the edges carrying most influence in the whole graph
        score = (normalize_matrix(A) * graph.influence()[:, None]).flatten()  # (N·N,)
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep[score.topk(max_edges).indices] = True
        pruned = Pruned(torch.ones(A.shape[0], dtype=torch.bool),
                        keep.view_as(A) & nonzero, graph.influence())
    data = graph_to_json(graph, slug=slug, prompt_tokens=None if prompt_tokens is None
                         else list(prompt_tokens), pruned=pruned, supernodes=supernodes,
                         node_threshold=node_threshold)
    labels: list[str | None] = [None] * A.shape[0]
    for k, text in enumerate(logit_tokens or []):
        labels[graph.logits.start + k] = str(text)
    for node in data["nodes"]:
        for key in ("influence", "activation", "token_prob"):
            if isinstance(node.get(key), float):
                node[key] = _finite(node[key])
    data["view"] = {
        "version": 1, "n_layers": graph.n_layers,
        "scores": {"replacement": _finite(graph.replacement_score),
                   "completeness": _finite(graph.completeness_score)},
        "thresholds": {"node": node_threshold, "edge": edge_threshold},
        "row_abs": A.abs().sum(1).double().tolist(), "edges_total": total,
        "labels": labels, "cards": dict(cards or {})}
    return data


def render_graph_html(graph: AttributionGraph, *, title: str | None = None, **options: Any
                      ) -> str:
    """The self-contained page of ``graph`` as a string.

    Args:
        graph: the graph.
        title: the page's title (default: the slug).
        **options: as :func:`graph_view_data`.

    Returns:
        The HTML document.
    """
    from handformer.viz.graph_page import graph_page

    data = graph_view_data(graph, **options)
    sc = data["view"]["scores"]
    note = (f"{graph.n_features} features, {graph.n_layers} layers x {graph.n_positions} "
            f"positions; replacement score {sc['replacement'] or float('nan'):.3f}, "
            f"completeness score {sc['completeness'] or float('nan'):.3f}")
    return graph_page(data, title=title, note=note)


def save_graph_html(graph: AttributionGraph, path: str | os.PathLike, *,
                    title: str | None = None, **options: Any) -> Path:
    """Write the interactive graph view as one HTML file that needs no network (styles,
    script and data inline), atomically (a temporary file, then renamed).

    Args:
        graph: the graph.
        path: the ``.html`` file; its folder must exist.
        title: the page's title (default: the slug).
        **options: as :func:`graph_view_data` (``prompt_tokens``, ``logit_tokens``,
            ``supernodes``, ``slug``, ``cards``, ``node_threshold``, ``edge_threshold``,
            ``max_edges``).

    Returns:
        The path written.

    Raises:
        ValueError: for a path not ending in ``.html`` / ``.htm``, or bad options.
        OSError: when the file cannot be written.
    """
    from handformer.viz.files import write_atomic

    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"path must end in .html or .htm, got {str(path)!r}")
    page = render_graph_html(graph, title=title, **options)
    return write_atomic(path, page.encode("utf-8"))


def graph_feature_cards(model: nn.Module, transcoders: Any, graph: AttributionGraph,
                        corpus: object, *, tokenizer: object = None,
                        nodes: Sequence[int] | None = None, tokens: int = 20_000,
                        context: int = 64, k: int = 8, top_tokens: int = 8
                        ) -> dict[str, dict[str, Any]]:
    """Cards for the graph's feature nodes, for :func:`save_graph_html`: each feature's
    top-activating contexts in ``corpus`` (:func:`~handformer.features.feature_cards`) and
    the tokens its decoder row promotes and suppresses
    (:func:`~handformer.features.feature_logit_effects`).

    Args:
        model: the causal LM the graph is of.
        transcoders: its transcoders, one per layer (as :func:`attribution_graph` takes).
        graph: the graph.
        corpus: a corpus name or object, or a ``(T,)`` id tensor (as ``feature_cards``).
        tokenizer: for the contexts' text and the tokens' labels.
        nodes: the feature nodes (indices into the graph) to make cards for; default all.
        tokens: corpus tokens read per layer.
        context: the window length (at most the model's context).
        k: contexts per card.
        top_tokens: tokens listed each way.

    Returns:
        ``{"layer_feature": card}``.

    Raises:
        ValueError: for a node that is not a feature node, a layer without a transcoder.
    """
    from handformer.features.analysis import feature_cards, feature_logit_effects
    from handformer.features.replacement import check_transcoders

    tcs = check_transcoders(model, transcoders)
    chosen = list(range(graph.n_features)) if nodes is None else list(nodes)
    by_layer: dict[int, list[int]] = {}
    for i in chosen:
        if not (isinstance(i, int) and 0 <= i < graph.n_features):
            raise ValueError(f"nodes: {i!r} is not a feature node (0..{graph.n_features - 1})")
        layer, _, f = graph.features[i].tolist()
        if tcs[layer] is None:
            raise ValueError(f"nodes: node {i} is a feature of layer {layer}, which has no "
                             "transcoder")
        by_layer.setdefault(layer, [])
        if f not in by_layer[layer]:
            by_layer[layer].append(f)
    out: dict[str, dict[str, Any]] = {}
    for layer, feats in sorted(by_layer.items()):
        tc = tcs[layer]
        made = feature_cards(model, tc, corpus, feats, at=f"blocks.{layer}.hook_mlp_out",
                             tokens=tokens, k=k, tokenizer=tokenizer, context=min(
                                 context, getattr(model.config, "max_len", context)))
        for f, card in zip(feats, made, strict=True):
            effects = feature_logit_effects(model, tc, f, k=top_tokens, tokenizer=tokenizer)
            label = (effects.top_tokens, effects.bottom_tokens) if tokenizer is not None else (
                [str(int(t)) for t in effects.top_ids],
                [str(int(t)) for t in effects.bottom_ids])
            out[f"{layer}_{f}"] = {
                "contexts": [{"before": c.before, "token": c.token, "after": c.after,
                              "activation": round(c.activation, 4), "source": "corpus"}
                             for c in card.contexts],
                "density": card.density, "tokens_seen": card.tokens, "texts_seen": 0,
                "where": "the corpus",
                "promoted": [{"token": t, "value": round(float(v), 4)}
                             for t, v in zip(label[0], effects.top_values, strict=True)],
                "suppressed": [{"token": t, "value": round(float(v), 4)}
                               for t, v in zip(label[1], effects.bottom_values, strict=True)]}
    return out
