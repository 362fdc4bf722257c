"""Check a graph in the real model: ablate or steer the features it names, see the logit move.

The graph's edges are direct effects in a frozen replacement; the real model is not frozen
(its attention and norms respond, later features change). :func:`intervene` sets chosen
features to ``scale ×`` their activation in the **real** model — the transcoders spliced with
their error terms (:func:`~handformer.features.attach`), so that with nothing changed the model
is exactly itself — and reports the change of each target logit (before any soft-cap) next to
what the graph predicts: the sum of the features' direct edges to it times ``scale − 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from handformer.features.attach import attach
from handformer.features.graph import AttributionGraph
from handformer.features.replacement import per_layer
from handformer.inspect.run import hooks

__all__ = ["Intervention", "intervene"]


@dataclass
class Intervention:
    """What an intervention did to the graph's logit targets.

    Attributes:
        labels: the logit targets' labels.
        before: ``(n_logits,)`` their values in the real model (before any soft-cap).
        after: ``(n_logits,)`` with the features set.
        real_effect: ``after − before``.
        graph_effect: ``(n_logits,)`` the graph's direct-effect prediction.
    """

    labels: list[str]
    before: Tensor
    after: Tensor
    real_effect: Tensor
    graph_effect: Tensor


def _logits(model: nn.Module, ids: Tensor, spec: dict[str, Any], graph: AttributionGraph
            ) -> Tensor:
    """The graph's logit targets in a run of the real model with ``spec``'s hooks."""
    final_name = ("ln_final.hook_normalized" if getattr(model, "ln_final", None) is not None
                  else f"blocks.{len(model.blocks) - 1}.hook_resid_post")
    final: list[Tensor] = []
    spec = dict(spec)
    spec[final_name] = lambda t, n: final.append(t)
    with torch.no_grad(), hooks(model, spec):
        model(ids[None])
        lg = model.lm_head(final[0][0, graph.logit_position])  # (V,) before any soft-cap
    minus = graph.logit_minus
    return lg[graph.logit_tokens] - lg[minus.clamp(min=0)] * (minus >= 0)


def intervene(model: nn.Module, transcoders: Any, graph: AttributionGraph,
              nodes: Sequence[int], *, scale: float = 0.0) -> Intervention:
    """Set the graph's feature ``nodes`` to ``scale ×`` their activation in the real model.

    Args:
        model: the model the graph was made from (eval mode).
        transcoders: the same transcoders (a list or ``{layer: transcoder}``).
        graph: the graph.
        nodes: indices of feature nodes of the graph.
        scale: 0 ablates; 2 doubles; -1 flips.

    Returns:
        An :class:`Intervention`.

    Raises:
        ValueError: for no nodes, or a node that is not a feature node of the graph.
    """
    nodes = list(nodes)
    if not nodes:
        raise ValueError(f"nodes is empty: name at least one of the graph's {graph.n_features} "
                         "feature nodes (the indices below graph.n_features)")
    for n in nodes:
        if not isinstance(n, int) or not 0 <= n < graph.n_features:
            raise ValueError(f"nodes: {n!r} is not a feature node (0..{graph.n_features - 1})")
    tcs = per_layer(transcoders, len(model.blocks))
    ids = graph.input_ids
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for n in nodes:
        layer, pos, f = graph.features[n].tolist()
        by_layer.setdefault(layer, []).append((pos, f))

    def setter(places: list[tuple[int, int]]) -> Any:
        def fn(t: Tensor, name: str) -> Tensor:
            t = t.clone()
            for pos, f in places:
                t[0, pos, f] = t[0, pos, f] * scale
            return t
        return fn

    spliced = {f"blocks.{i}.mlp": tcs[i] for i in by_layer}
    with attach(model, spliced):
        before = _logits(model, ids, {}, graph)
        after = _logits(model, ids, {f"blocks.{i}.hook_mlp_out.hook_sae_acts_post": setter(p)
                                     for i, p in by_layer.items()}, graph)
    rows = graph.adjacency[graph.logits]  # (n_logits, N)
    graph_effect = rows[:, list(nodes)].sum(1) * (scale - 1)
    labels = graph.node_labels[graph.logits]
    return Intervention(labels, before, after, after - before, graph_effect.detach())
