"""Attribution graphs on tiny float64 models: the replacement is the model on its prompt, every
edge is the direct effect it claims (removing the source in the frozen replacement moves the
target by exactly the edge), a target's edges plus its constant are its pre-activation, and
the scores and pruning follow the paper's definitions on a graph worked by hand."""

from __future__ import annotations

import pytest
import torch

from graph_util import GPT2, LLAMA, tiny
from handformer.attention.functional import soft_cap
from handformer.features import attribution_graph
from handformer.features.influence import graph_scores, prune
from handformer.features.replacement import ReplacementModel
from handformer.inspect import run_with_cache


@pytest.mark.parametrize("kind", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_replacement_output_is_the_models(kind: dict, dtype: torch.dtype, tol: float) -> None:
    model, tcs, ids = tiny(kind, dtype)
    rep = ReplacementModel(model, tcs, ids)
    out = rep.run()
    real = model(ids[None]).logits
    assert (soft_cap(out.logits, model.config.final_softcap) - real).abs().max() <= tol
    assert rep.errors.abs().max() > 1e-3  # the transcoders are far from the MLPs: errors matter


def _sources(rep: ReplacementModel) -> tuple[torch.Tensor, list, torch.Tensor]:
    return (rep.embed.clone(), [None if a is None else a.clone() for a in rep.acts],
            rep.errors.clone())


def _target_value(rep: ReplacementModel, graph, t: int, sources) -> float:
    with torch.no_grad():
        out = rep.run(*sources)
    if t < graph.n_features:
        layer, pos, f = graph.features[t].tolist()
        return float(out.pre[layer][0, pos, f])
    k = t - graph.logits.start
    a, b = int(graph.logit_tokens[k]), int(graph.logit_minus[k])
    lg = out.logits[0, -1]
    return float(lg[a] - (lg[b] if b >= 0 else 0))


def _remove(graph, s: int, sources) -> None:
    embed, acts, errors = sources
    L = graph.n_positions
    if s < graph.n_features:
        layer, pos, f = graph.features[s].tolist()
        acts[layer][0, pos, f] = 0
    elif s < graph.errors.stop:
        layer, pos = divmod(s - graph.errors.start, L)
        errors[layer, 0, pos] = 0
    else:
        embed[0, s - graph.tokens.start] = 0


@pytest.mark.parametrize("kind", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_every_edge_is_the_direct_effect(kind: dict) -> None:
    model, tcs, ids = tiny(kind)
    graph = attribution_graph(model, tcs, ids, targets=[3, (5, 7)])
    rep = ReplacementModel(model, tcs, ids)
    A = graph.adjacency
    gen = torch.Generator().manual_seed(1)
    feat_targets = [int(t) for t in torch.randperm(graph.n_features, generator=gen)[:3]
                    if graph.features[t, 0] > 0]  # features of layers 1, 2 have inputs
    targets = feat_targets + list(range(graph.logits.start, graph.logits.stop))
    sources = (torch.randperm(graph.n_features, generator=gen)[:12].tolist()
               + list(range(graph.errors.start, graph.tokens.stop)))
    checked = 0
    for t in targets:
        base = _target_value(rep, graph, t, _sources(rep))
        assert base == pytest.approx(float(graph.pre_activations[t]), abs=1e-9)
        for s in sources:
            srcs = _sources(rep)
            _remove(graph, s, srcs)
            change = base - _target_value(rep, graph, t, srcs)
            assert abs(change - float(A[t, s])) <= 1e-9, (graph.node_labels[t],
                                                           graph.node_labels[s])
            checked += abs(float(A[t, s])) > 1e-6
    assert checked > 20  # many real (non-zero) edges were compared


@pytest.mark.parametrize("kind", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("cap", [None, 10])
def test_edges_plus_constant_is_the_pre_activation(kind: dict, cap: int | None) -> None:
    model, tcs, ids = tiny(kind)
    graph = attribution_graph(model, tcs, ids, max_feature_nodes=cap)
    rows = torch.isfinite(graph.pre_activations)
    assert int(rows.sum()) == graph.n_features + graph.logit_tokens.shape[0]
    assert (graph.biases[rows].abs() > 1e-3).any()  # constants are really there
    total = graph.adjacency[rows].sum(1) + graph.biases[rows]
    assert (total - graph.pre_activations[rows]).abs().max() <= 1e-9
    assert (graph.adjacency[~rows] == 0).all()  # input nodes have no incoming edges
    if cap is not None:
        assert graph.n_features == cap
    # a feature's pre-activation is the transcoder's on the real MLP input
    rep = ReplacementModel(model, tcs, ids)
    layer, pos, f = graph.features[-1].tolist()
    pre = tcs[layer].pre_activation(rep.mlp_in_real[layer])[0, pos, f]
    assert float(pre) == pytest.approx(float(graph.pre_activations[graph.n_features - 1]),
                                       abs=1e-12)


def test_automatic_targets_cover_the_probability() -> None:
    model, tcs, ids = tiny(GPT2)
    graph = attribution_graph(model, tcs, ids, desired_logit_prob=0.5, max_n_logits=40)
    probs = model(ids[None]).logits[0, -1].softmax(-1)
    top = probs.sort(descending=True)
    n = graph.logit_tokens.shape[0]
    assert graph.logit_tokens.tolist() == top.indices[:n].tolist()
    assert float(top.values[:n].sum()) >= 0.5 > float(top.values[:n - 1].sum())
    with pytest.raises(ValueError, match="targets"):
        attribution_graph(model, tcs, ids, targets=[99])
    with pytest.raises(ValueError, match="transcoders"):
        attribution_graph(model, tcs[:2], ids)


def test_scores_and_pruning_on_a_graph_worked_by_hand() -> None:
    # nodes: 0 feature, 1 error, 2 token, 3 logit; feature <- token (3), error (1);
    # logit <- feature (2), error (-2), token (4)
    A = torch.zeros(4, 4, dtype=torch.float64)
    A[0, 2], A[0, 1] = 3.0, 1.0
    A[3, 0], A[3, 1], A[3, 2] = 2.0, -2.0, 4.0
    w = torch.tensor([0, 0, 0, 1.0], dtype=torch.float64)
    replacement, completeness = graph_scores(A, w, slice(1, 2), slice(2, 3))
    # influence: feature 0.25; error 0.25 + 0.25·0.25; token 0.5 + 0.25·0.75
    token, error = 0.5 + 0.25 * 0.75, 0.25 + 0.25 * 0.25
    assert replacement == pytest.approx(token / (token + error))
    # non-error shares: feature 0.75, logit 0.75; weights: feature 0.25, logit 1 (+ error,
    # token with non-error share 1 and their influence)
    num = 0.75 * 0.25 + 1 * error + 1 * token + 0.75 * 1
    den = 0.25 + error + token + 1
    assert completeness == pytest.approx(num / den)
    always = torch.tensor([False, False, True, True])
    kept = prune(A, w, always, node_threshold=0.5, edge_threshold=1.0)
    assert kept.node_mask.tolist() == [False, False, True, True]  # token holds > 0.5 alone
    assert kept.edge_mask.sum() == 1 and kept.edge_mask[3, 2]
    with pytest.raises(ValueError, match="node_threshold"):
        prune(A, w, always, node_threshold=0)


def test_a_layer_without_transcoder_is_all_error() -> None:
    model, tcs, ids = tiny(LLAMA)
    graph = attribution_graph(model, {0: tcs[0], 2: tcs[2]}, ids, targets=[1])
    assert set(graph.features[:, 0].tolist()) <= {0, 2}
    rep = ReplacementModel(model, [tcs[0], None, tcs[2]], ids)
    _, cache = run_with_cache(model, ids[None], names="blocks.1.hook_mlp_out")
    assert torch.allclose(rep.errors[1], cache["blocks.1.hook_mlp_out"], atol=1e-12)  # all error
    rows = torch.isfinite(graph.pre_activations)
    total = graph.adjacency[rows].sum(1) + graph.biases[rows]
    assert (total - graph.pre_activations[rows]).abs().max() <= 1e-9
