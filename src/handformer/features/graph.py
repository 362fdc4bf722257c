"""Attribution graphs: the direct effects between the nodes of a prompt's replacement model.

:func:`attribution_graph` builds the :class:`~handformer.features.replacement.ReplacementModel`
of a prompt, then one row of the adjacency per *target* node — an active feature's
pre-activation, a logit before any soft-cap — by backward passes through the frozen, linear
replacement, many rows per pass (``torch.autograd.grad(..., is_grads_batched=True)``): the
gradient of the target with respect to every source, times the source's value, is that
source's **direct effect** on the target, every other feature activation and error held.

Nodes, in this order (circuit-tracer's): the kept features (layer, position, feature), the
error nodes (layer-major: ``layer · L + position``), the token embeddings (one per position),
the logit targets. ``adjacency[t, s]`` is the direct effect of source ``s`` on target ``t``
(rows of input nodes are zero). **Constants** are not nodes: ``biases[t]`` is the whole
constant term of target ``t`` — what the replacement gives it with every source set to zero:
its own ``b_enc`` (or the LM head's bias), and every ``b_dec``, ``b_V W_O + b_O`` (a frozen
pattern's rows sum to 1), norm bias ``β``, learned position embedding that reaches it through
the frozen linear paths. So ``adjacency[t].sum() + biases[t] == pre_activations[t]``.

When ``max_feature_nodes`` caps the features, the ones kept are those with the most influence
on the logits (rows computed in rounds, circuit-tracer's way); the others are not nodes: their
contributions are added to their (layer, position)'s error node, so every row stays exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from handformer.features.influence import Pruned, graph_scores, influence, normalize_matrix, prune
from handformer.features.replacement import ReplacementModel

__all__ = ["AttributionGraph", "attribution_graph"]


@dataclass
class AttributionGraph:
    """A prompt's attribution graph (see the module docs for the node order).

    Attributes:
        input_ids: ``(L,)`` the prompt.
        n_layers: the model's layers.
        features: ``(n_f, 3)`` ``(layer, position, feature)`` of each feature node.
        activations: ``(n_f,)`` their activations.
        logit_tokens: ``(n_logits,)`` the target tokens (for a logit difference, the first).
        logit_minus: ``(n_logits,)`` the subtracted token of a logit difference, else -1.
        logit_weights: ``(n_logits,)`` each target's weight (its probability; a difference
            or named tokens: their probabilities, renormalised to 1).
        logit_position: the position whose next token the logits predict (the last).
        adjacency: ``(N, N)`` targets × sources, direct effects.
        pre_activations: ``(N,)`` each target's value (NaN for input nodes).
        biases: ``(N,)`` each target's constant term (NaN for input nodes).
        node_labels: ``N`` strings (``"L3 F17 @5"``, ``"err L3 @5"``, ``"emb 464 @0"``,
            ``"logit 318 @6"``).
        replacement_score, completeness_score: the paper's scores (:mod:`influence`).
        timings: seconds per stage of :func:`attribution_graph` (``replacement``,
            ``forward``, ``logit_rows``, ``feature_rows``, ``assemble``, ``scores``).
        prompt_tokens: the prompt's token strings where known (a graph file's
            ``metadata.prompt_tokens``), else None.
        supernodes: groups of nodes ``[[name, node_id, ...], ...]`` (a graph file's
            ``qParams.supernodes``; :func:`~handformer.features.save_graph_json` writes them).
    """

    input_ids: Tensor
    n_layers: int
    features: Tensor
    activations: Tensor
    logit_tokens: Tensor
    logit_minus: Tensor
    logit_weights: Tensor
    logit_position: int
    adjacency: Tensor
    pre_activations: Tensor
    biases: Tensor
    node_labels: list[str] = field(default_factory=list)
    replacement_score: float = float("nan")
    completeness_score: float = float("nan")
    timings: dict[str, float] = field(default_factory=dict)
    prompt_tokens: list[str] | None = None
    supernodes: list[list[str]] = field(default_factory=list)

    @property
    def n_features(self) -> int:
        """Feature nodes."""
        return int(self.features.shape[0])

    @property
    def n_positions(self) -> int:
        """Prompt length ``L``."""
        return int(self.input_ids.shape[0])

    @property
    def errors(self) -> slice:
        """The error nodes' index range."""
        return slice(self.n_features, self.n_features + self.n_layers * self.n_positions)

    @property
    def tokens(self) -> slice:
        """The embedding nodes' index range."""
        start = self.errors.stop
        return slice(start, start + self.n_positions)

    @property
    def logits(self) -> slice:
        """The logit nodes' index range."""
        return slice(self.tokens.stop, self.tokens.stop + int(self.logit_tokens.shape[0]))

    def weights(self) -> Tensor:
        """``(N,)`` the logit weights at the logit nodes, 0 elsewhere."""
        w = torch.zeros(self.adjacency.shape[0], dtype=self.adjacency.dtype)
        w[self.logits] = self.logit_weights.to(w.dtype)
        return w

    def scores(self) -> tuple[float, float]:
        """``(replacement score, completeness score)`` of this graph."""
        return graph_scores(self.adjacency, self.weights(), self.errors, self.tokens)

    def influence(self) -> Tensor:
        """``(N,)`` each node's influence on the weighted logits (plus its own weight)."""
        w = self.weights()
        return influence(normalize_matrix(self.adjacency), w) + w

    def prune(self, *, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
        """The nodes and edges that carry most influence (see :func:`influence.prune`).

        Args:
            node_threshold: cumulative share of node influence kept, in ``(0, 1]``.
            edge_threshold: cumulative share of edge influence kept, in ``(0, 1]``.

        Raises:
            ValueError: for a threshold outside ``(0, 1]``.
        """
        always = torch.zeros(self.adjacency.shape[0], dtype=torch.bool)
        always[self.tokens.start:self.logits.stop] = True
        return prune(self.adjacency, self.weights(), always, node_threshold=node_threshold,
                     edge_threshold=edge_threshold)


def _check_targets(targets: Any, vocab: int) -> list[tuple[int, int]]:
    """``[(token, minus or -1), ...]`` from ints and (good, bad) pairs."""
    if isinstance(targets, (int, tuple)) or not isinstance(targets, Sequence) or not targets:
        raise ValueError(f"targets must be a non-empty list of token ids or (token, token) "
                         f"pairs (logit differences), got {targets!r}")
    out = []
    for t in targets:
        pair = (t, -1) if isinstance(t, int) else tuple(t) if isinstance(t, (tuple, list)) else ()
        if len(pair) != 2 or not all(isinstance(v, int) for v in pair) or not (
                0 <= pair[0] < vocab and -1 <= pair[1] < vocab):
            raise ValueError(f"targets: {t!r} is not a token id in 0..{vocab - 1} or a pair "
                             "of them")
        out.append(pair)
    return out


def _target_logits(head: nn.Module, h: Tensor, tok: Tensor, minus: Tensor) -> Tensor:
    """``logits[tok] − logits[minus]`` (``minus = -1``: nothing subtracted) from the LM head's
    rows of those tokens only: ``h`` ``(E,)``, the final norm's output at the last position,
    -> ``(n_logits,)``. The whole head's ``(V, E)`` product, and its gradient in every row of
    a batched backward pass, would cost most of a graph's time on a large vocabulary."""
    rows = torch.cat([tok, minus.clamp(min=0)])  # (2·n_logits,)
    bias = None if head.bias is None else head.bias[rows]
    values = nn.functional.linear(h, head.weight[rows], bias)  # (2·n_logits,)
    n = tok.shape[0]
    return values[:n] - values[n:] * (minus >= 0)


def attribution_graph(model: nn.Module, transcoders: Any, ids: Tensor, *,
                      targets: Sequence[int | tuple[int, int]] | None = None,
                      max_n_logits: int = 10, desired_logit_prob: float = 0.95,
                      max_feature_nodes: int | None = None, batch_size: int = 64
                      ) -> AttributionGraph:
    """The attribution graph of ``ids`` (see the module docs).

    Args:
        model: a handformer ``CausalLM`` in eval mode.
        transcoders: one :class:`~handformer.features.Transcoder` per layer (a list, or a
            ``{layer: transcoder}`` mapping; None: that MLP is all error).
        ids: ``(L,)`` or ``(1, L)`` the prompt.
        targets: token ids whose logits (at the last position) are targets, or
            ``(good, bad)`` pairs for logit differences; None: the most likely tokens until
            ``desired_logit_prob`` is covered, at most ``max_n_logits``.
        max_n_logits: the cap on automatic targets.
        desired_logit_prob: the cumulative probability automatic targets cover.
        max_feature_nodes: keep at most this many features (by influence); None: all active.
        batch_size: target rows per backward pass.

    Returns:
        An :class:`AttributionGraph`, with its scores.

    Raises:
        ValueError: for bad ``ids``, ``targets``, transcoders or options (naming them).
    """
    for name, value in (("max_n_logits", max_n_logits), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if max_feature_nodes is not None and (not isinstance(max_feature_nodes, int)
                                          or max_feature_nodes < 0):
        raise ValueError(f"max_feature_nodes must be None or an int >= 0, got "
                         f"{max_feature_nodes!r}")
    if not 0 < desired_logit_prob <= 1:
        raise ValueError(f"desired_logit_prob must be in (0, 1], got {desired_logit_prob!r}")
    if model.training:
        raise ValueError("model is in training mode (dropout): call model.eval() first")
    clock = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = timings.get(stage, 0.0) + now - clock
        clock = now

    rep = ReplacementModel(model, transcoders, ids)
    lap("replacement")
    L, n_layers = rep.ids.shape[0], rep.n_layers
    dtype = rep.embed.dtype
    logits_last = rep.logits[0, -1]  # (V,)
    probs = logits_last.softmax(-1).to(torch.float64)
    if targets is None:
        top = probs.sort(descending=True)
        n = int((top.values.cumsum(0) < desired_logit_prob).sum()) + 1
        n = min(n, max_n_logits)
        pairs = [(int(t), -1) for t in top.indices[:n]]
        weights = top.values[:n]
    else:
        pairs = _check_targets(list(targets), logits_last.shape[0])
        weights = torch.stack([probs[a] for a, _ in pairs])
        weights = weights / weights.sum()
    tok = torch.tensor([a for a, _ in pairs])
    minus = torch.tensor([b for _, b in pairs])

    # Sources: every active feature (a leaf per layer), the errors, the embeddings.
    active = [torch.zeros(0, 2, dtype=torch.long) if a is None else a[0].nonzero()
              for a in rep.acts]  # per layer (n_l, 2) (position, feature)
    all_feats = torch.cat([torch.cat([torch.full((len(a), 1), i), a], 1)
                           for i, a in enumerate(active)])  # (n_all, 3) layer, pos, feature
    n_all = all_feats.shape[0]
    embed = rep.embed.clone().requires_grad_(True)
    acts = [None if a is None else a.clone().requires_grad_(True) for a in rep.acts]
    errors = rep.errors.clone().requires_grad_(True)
    out = rep.run(embed, acts, errors, logits=False)
    # Every target value, one flat vector: all feature pre-activations, then the logits.
    pre_all = [out.pre[i][0][tuple(a.T)] for i, a in enumerate(active)
               if out.pre[i] is not None]
    lg = _target_logits(model.lm_head, out.final[0, -1], tok, minus)  # (n_logits,)
    y_dtype = pre_all[0].dtype if pre_all else dtype
    y = torch.cat(pre_all + [lg.to(y_dtype)])  # (n_all + n_logits,)
    leaves = [embed, errors] + [a for a in acts if a is not None]
    lap("forward")

    def rows(index: Tensor) -> Tensor:
        """``(R, n_all + L·n_layers + L)`` direct effects on the targets ``y[index]``."""
        seeds = torch.zeros(len(index), y.shape[0], dtype=y.dtype)
        seeds[torch.arange(len(index)), index] = 1
        grads = torch.autograd.grad(y, leaves, grad_outputs=seeds, retain_graph=True,
                                    is_grads_batched=True, allow_unused=True)
        g_embed, g_err = grads[0], grads[1]  # (R, 1, L, E), (R, n_layers, 1, L, E)
        e_embed = (g_embed * rep.embed).sum(-1)[:, 0]  # (R, L)
        e_err = (g_err * rep.errors).sum(-1)[:, :, 0].flatten(1)  # (R, n_layers·L)
        e_feat = []
        g_acts = iter(grads[2:])
        for i, a in enumerate(active):
            if rep.acts[i] is None:
                continue
            g = next(g_acts)
            g = torch.zeros_like(rep.acts[i]).expand(len(index), -1, -1, -1) if g is None else g
            e_feat.append(g[:, 0, a[:, 0], a[:, 1]] * rep.acts[i][0][tuple(a.T)])  # (R, n_l)
        return torch.cat(e_feat + [e_err.to(y.dtype), e_embed.to(y.dtype)], 1).detach()

    n_logit = len(pairs)
    computed: dict[int, Tensor] = {}  # y index -> its row over all sources
    cap = n_all if max_feature_nodes is None else min(max_feature_nodes, n_all)
    # The rows as fractions of their |inputs| (for choosing features), filled as they come.
    normed = torch.zeros(0 if cap == n_all else cap + n_logit, n_all + (n_layers + 1) * L,
                         dtype=torch.float32)
    row_ids: list[int] = []

    def compute(indices: list[int]) -> None:
        for start in range(0, len(indices), batch_size):
            chunk = torch.tensor(indices[start:start + batch_size])
            block = rows(chunk)  # (R, C)
            for k, row in zip(chunk.tolist(), block, strict=True):
                computed[k] = row
            if normed.shape[0]:
                a = block.abs().float()
                normed[len(row_ids):len(row_ids) + len(chunk)] = a / a.sum(
                    1, keepdim=True).clamp(min=1e-10)
                row_ids.extend(chunk.tolist())

    logit_rows = list(range(n_all, n_all + n_logit))
    compute(logit_rows)
    lap("logit_rows")
    selected: list[int] = []
    if cap == n_all:
        selected = list(range(n_all))
        compute(selected)
    else:
        while len(selected) < cap:  # rounds: the most influential features not yet visited
            R = normed[:len(row_ids)]  # (rows, C)
            w = torch.tensor([float(weights[k - n_all]) if k >= n_all else 0.0
                              for k in row_ids])
            is_feat = torch.tensor([k < n_all for k in row_ids])
            cols = torch.tensor([k if k < n_all else 0 for k in row_ids])
            total = torch.zeros(R.shape[1])
            cur = w
            for _ in range(n_layers + 2):
                contrib = cur @ R  # (C,)
                total += contrib
                cur = torch.where(is_feat, contrib[cols], torch.zeros(()))
            score = total[:n_all].clone()
            score[torch.tensor(selected, dtype=torch.long)] = -1
            n_new = min(batch_size, cap - len(selected))
            new = score.argsort(descending=True)[:n_new].tolist()
            selected += new
            compute(new)
        selected.sort()
    lap("feature_rows")

    # Merge the features left out into their (layer, position)'s error column.
    sel = torch.tensor(selected, dtype=torch.long)
    left = torch.ones(n_all, dtype=torch.bool)
    left[sel] = False
    err_col = all_feats[:, 0] * L + all_feats[:, 1]  # (n_all,) the error node of each feature
    n_f = len(selected)
    N = n_f + n_layers * L + L + n_logit
    A = torch.zeros(N, N, dtype=y.dtype)
    order = selected + logit_rows
    full = torch.stack([computed[k] for k in order])  # (n_f + n_logit, C)
    merged = full[:, n_all:].clone()  # (rows, errors + embeddings)
    merged[:, :n_layers * L].index_add_(1, err_col[left], full[:, :n_all][:, left])
    body = torch.cat([full[:, sel], merged], 1)  # (rows, n_f + errors + embeddings)
    A[:n_f, :body.shape[1]] = body[:n_f]
    A[N - n_logit:, :body.shape[1]] = body[n_f:]

    # Constants: the replacement with every source at zero.
    with torch.no_grad():
        zero = rep.run(torch.zeros_like(rep.embed),
                       [None if a is None else torch.zeros_like(a) for a in rep.acts],
                       torch.zeros_like(rep.errors), logits=False)
        zl = _target_logits(model.lm_head, zero.final[0, -1], tok, minus)  # (n_logits,)
        const_all = [zero.pre[i][0][tuple(a.T)] for i, a in enumerate(active)
                     if zero.pre[i] is not None]
        const = torch.cat(const_all + [zl.to(y.dtype)])
    nan = torch.full((N,), float("nan"), dtype=y.dtype)
    pre_activations, biases = nan.clone(), nan.clone()
    idx = torch.tensor(order, dtype=torch.long)
    tgt = torch.cat([torch.arange(n_f), torch.arange(N - n_logit, N)])
    pre_activations[tgt] = y.detach()[idx]
    biases[tgt] = const[idx]

    feats = all_feats[sel]
    act_vals = torch.stack([rep.acts[int(f[0])][0, f[1], f[2]] for f in feats]) if n_f else \
        torch.zeros(0, dtype=dtype)
    labels = [f"L{f[0]} F{f[2]} @{f[1]}" for f in feats.tolist()]
    labels += [f"err L{i} @{p}" for i in range(n_layers) for p in range(L)]
    labels += [f"emb {int(t)} @{p}" for p, t in enumerate(rep.ids)]
    labels += [f"logit {a}" + (f"-{b}" if b >= 0 else "") + f" @{L - 1}" for a, b in pairs]
    graph = AttributionGraph(rep.ids.clone(), n_layers, feats, act_vals.detach(), tok, minus,
                             weights.to(torch.float64), L - 1, A, pre_activations, biases,
                             labels)
    lap("assemble")
    graph.replacement_score, graph.completeness_score = graph.scores()
    lap("scores")
    graph.timings = timings
    return graph
