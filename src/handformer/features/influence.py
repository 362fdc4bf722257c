"""Influence, pruning and the two scores of an attribution graph (Ameisen et al. 2025, §
"Graph pruning" and "Evaluating graphs").

The graph's adjacency ``A`` (targets × sources, direct effects) is first *normalised*: absolute
values, each row divided by its sum (a node's inputs as fractions). A node's *influence* on the
output is the weight of every path from it to the logits, each logit weighted by its
probability ``w``: ``influence = w (Â + Â² + Â³ + ...)`` (``Â`` is nilpotent, the graph has no
cycles, so the series stops).

- **Pruning** keeps the nodes that carry ``node_threshold`` of the total influence (sorted,
  cumulative), then the edges carrying ``edge_threshold`` of the influence they pass on
  (``Â[t, s] · (influence[t] + w[t])``); logits and token embeddings are always kept.
- **Replacement score**: the share of the influence that ends at token embeddings rather than
  error nodes (1: the features explain everything, through no error node, at any depth).
- **Completeness score**: how much of each node's input comes from non-error nodes, averaged
  over the nodes weighted by their influence plus the logit weights (direct inputs only).

Node order everywhere: features, then errors, then embeddings, then logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["normalize_matrix", "influence", "graph_scores", "prune", "Pruned"]


def normalize_matrix(A: Tensor) -> Tensor:
    """``|A|`` with each row divided by its sum (rows of zeros stay zero).

    Args:
        A: ``(N, N)`` targets × sources.
    """
    A = A.abs()
    return A / A.sum(dim=1, keepdim=True).clamp(min=1e-10)


def influence(A_norm: Tensor, weights: Tensor, *, max_iter: int = 1000) -> Tensor:
    """``weights (Â + Â² + ...)``: every node's influence on the weighted targets.

    Args:
        A_norm: ``(N, N)`` the normalised adjacency (no cycles).
        weights: ``(N,)`` the logits' probabilities, 0 elsewhere.
        max_iter: refuse graphs whose paths are longer (a cycle).

    Raises:
        ValueError: when the series does not stop (the adjacency has a cycle).
    """
    current = weights @ A_norm  # (N,)
    total = current.clone()
    for _ in range(max_iter):
        if not current.any():
            return total
        current = current @ A_norm
        total += current
    raise ValueError("influence: the adjacency has a cycle (the series does not stop)")


def graph_scores(A: Tensor, weights: Tensor, errors: slice, tokens: slice) -> tuple[float, float]:
    """``(replacement score, completeness score)`` of a graph (see the module docs).

    Args:
        A: ``(N, N)`` adjacency (targets × sources).
        weights: ``(N,)`` logit probabilities at the logit nodes, 0 elsewhere.
        errors: the error nodes' index range.
        tokens: the embeddings' index range.
    """
    A_norm = normalize_matrix(A)
    node_influence = influence(A_norm, weights)
    token_influence = node_influence[tokens].sum()
    error_influence = node_influence[errors].sum()
    replacement = token_influence / (token_influence + error_influence).clamp(min=1e-30)
    non_error = 1 - A_norm[:, errors].sum(dim=1)  # (N,) each node's input share not from errors
    output_influence = node_influence + weights
    completeness = (non_error * output_influence).sum() / output_influence.sum()
    return float(replacement), float(completeness)


@dataclass
class Pruned:
    """What :func:`prune` keeps.

    Attributes:
        node_mask: ``(N,)`` bool.
        edge_mask: ``(N, N)`` bool (targets × sources).
        influence: ``(N,)`` each node's influence plus its logit weight.
    """

    node_mask: Tensor
    edge_mask: Tensor
    influence: Tensor


def _keep_cumulative(scores: Tensor, threshold: float) -> Tensor:
    """The mask of the largest ``scores`` that together hold ``threshold`` of their sum."""
    flat = scores.flatten()
    order = flat.argsort(descending=True)
    cumulative = flat[order].cumsum(0) / flat.sum().clamp(min=1e-30)
    n_keep = int((cumulative < threshold).sum()) + 1  # the node that crosses it too
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[order[:n_keep]] = True
    return mask.view_as(scores)


def prune(A: Tensor, weights: Tensor, always: Tensor, *, node_threshold: float = 0.8,
          edge_threshold: float = 0.98) -> Pruned:
    """Keep the nodes and edges that carry most of the influence (see the module docs).

    Args:
        A: ``(N, N)`` adjacency.
        weights: ``(N,)`` logit weights.
        always: ``(N,)`` bool, nodes kept whatever their influence (logits, embeddings).
        node_threshold: the cumulative share of node influence kept, in ``(0, 1]``.
        edge_threshold: the cumulative share of edge influence kept, in ``(0, 1]``.

    Raises:
        ValueError: for a threshold outside ``(0, 1]``.
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    A_norm = normalize_matrix(A)
    node_influence = influence(A_norm, weights) + weights
    node_mask = _keep_cumulative(node_influence, node_threshold) | always
    A_kept = A_norm * node_mask[:, None] * node_mask[None, :]  # (N, N) between kept nodes
    A_kept = normalize_matrix(A_kept)
    kept_influence = influence(A_kept, weights) + weights
    edge_scores = A_kept * kept_influence[:, None]  # (N, N) influence an edge passes on
    edge_mask = _keep_cumulative(edge_scores, edge_threshold) & (A_kept > 0)
    while True:  # drop the nodes left without edges (logits and embeddings stay)
        has_edge = edge_mask.any(dim=0) | edge_mask.any(dim=1)
        new_mask = node_mask & (has_edge | always)
        if torch.equal(new_mask, node_mask):
            break
        node_mask = new_mask
        edge_mask &= node_mask[:, None] & node_mask[None, :]
    return Pruned(node_mask, edge_mask, node_influence)
