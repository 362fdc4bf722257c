"""Around attribution graphs: the JSON round trip circuit-tracer's page reads, the drawing,
interventions in the real model, and run_with_cache's gradients (incl_bwd)."""

from __future__ import annotations

import json

import pytest
import torch

from graph_util import GPT2, LLAMA, tiny
from handformer.features import attribution_graph
from handformer.features.graph_draw import draw_graph
from handformer.features.graph_io import GraphFileError, load_graph_json, save_graph_json
from handformer.features.interventions import intervene
from handformer.inspect import run_with_cache, run_with_hooks


def test_json_round_trip_keeps_nodes_edges_and_scores(tmp_path) -> None:
    model, tcs, ids = tiny(GPT2)
    graph = attribution_graph(model, tcs, ids, max_feature_nodes=15)
    layer, pos, f = graph.features[0].tolist()
    group = ["first", f"{layer}_{f}_{pos}", f"{layer}_-1_{pos}"]
    path = save_graph_json(graph, tmp_path / "g.json", slug="tiny", supernodes=[group])
    data = json.loads(path.read_text())
    assert set(data) == {"metadata", "qParams", "nodes", "links"}
    kinds = {n["feature_type"] for n in data["nodes"]}
    assert kinds == {"cross layer transcoder", "mlp reconstruction error", "embedding", "logit"}
    assert any(n["node_id"] == f"{layer}_{f}_{pos}" for n in data["nodes"])
    assert data["qParams"]["supernodes"] == [group]
    with pytest.raises(ValueError, match="supernodes: 'x' names nodes not in the graph"):
        save_graph_json(graph, tmp_path / "s.json", supernodes=[["x", "99_1_1"]])
    back = load_graph_json(path)
    assert torch.equal(back.features, graph.features)
    assert torch.allclose(back.adjacency.double(), graph.adjacency, rtol=1e-6, atol=1e-9)
    assert back.replacement_score == pytest.approx(graph.replacement_score, abs=1e-5)
    assert back.completeness_score == pytest.approx(graph.completeness_score, abs=1e-5)
    pruned = graph.prune(node_threshold=0.5, edge_threshold=0.9)
    small = json.loads(save_graph_json(graph, tmp_path / "p.json", pruned=pruned).read_text())
    assert len(small["nodes"]) == int(pruned.node_mask.sum())
    assert len(small["links"]) == int(pruned.edge_mask.sum())
    data["links"][0]["source"] = "nowhere"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(GraphFileError, match=r"bad.json: links\[0\]: unknown node 'nowhere'"):
        load_graph_json(tmp_path / "bad.json")


def test_drawing_writes_png_and_svg(tmp_path) -> None:
    model, tcs, ids = tiny(LLAMA)
    graph = attribution_graph(model, tcs, ids, max_feature_nodes=10)
    png = draw_graph(graph, tmp_path / "g.png", pruned=graph.prune())
    svg = draw_graph(graph, tmp_path / "g.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in svg.read_bytes()[:400]
    with pytest.raises(ValueError, match="path must end"):
        draw_graph(graph, tmp_path / "g.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.png", "g.svg"]  # no temp files


@pytest.mark.parametrize("kind", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_intervention_in_the_real_model(kind: dict) -> None:
    model, tcs, ids = tiny(kind)
    graph = attribution_graph(model, tcs, ids, targets=[3])
    L = graph.n_positions
    last = graph.n_layers - 1  # features of the last layer at the last position: no feature
    nodes = [i for i in range(graph.n_features)  # lies between them and the logit
             if graph.features[i, 0] == last and graph.features[i, 1] == L - 1]
    same = intervene(model, tcs, graph, nodes, scale=1.0)
    assert same.real_effect.abs().max() <= 1e-12  # spliced with errors: the model itself
    res = intervene(model, tcs, graph, nodes, scale=0.0)
    # reference: subtract the features' decoder rows from the MLP output by hand
    s = tcs[last].scale(torch.zeros(1))  # no input scaling: None
    assert s is None
    rows = tcs[last].W_dec.detach()[graph.features[nodes, 2]]  # (n, E)
    delta = (graph.activations[nodes, None] * rows).sum(0)

    def minus(t, name):
        t = t.clone()
        t[0, L - 1] -= delta
        return t

    def logit(extra: dict) -> float:
        final = []
        run_with_hooks(model, ids[None], hooks={**extra, "ln_final.hook_normalized":
                                                lambda t, n: final.append(t)})
        return float(model.lm_head(final[0][0, -1])[3].detach())

    mlp_out = f"blocks.{last}.hook_mlp_out"
    assert float(res.after[0]) == pytest.approx(logit({mlp_out: minus}), abs=1e-10)
    assert float(res.real_effect[0]) != 0
    # the graph's prediction is the real effect with the final norm's scale frozen
    _, cache = run_with_cache(model, ids[None], names="ln_final.hook_scale")
    frozen = {mlp_out: minus, "ln_final.hook_scale": lambda t, n: cache["ln_final.hook_scale"]}
    assert float(res.graph_effect[0]) == pytest.approx(logit(frozen) - logit({}), abs=1e-10)
    with pytest.raises(ValueError, match="nodes"):
        intervene(model, tcs, graph, [graph.n_features])


def test_run_with_cache_keeps_gradients_at_every_point() -> None:
    model, _, ids = tiny(GPT2)
    names = ["hook_embed", "blocks.1.hook_resid_pre", "blocks.1.attn.hook_pattern",
             "blocks.2.ln2.hook_scale"]
    out, cache = run_with_cache(model, ids[None], names=names,
                                incl_bwd=lambda o: o.logits[0, -1, 3])
    assert set(cache) == set(names) | {n + "_grad" for n in names}
    # reference: the gradient at resid_pre of block 1 by perturbing it (finite differences)
    direction = torch.randn_like(cache["blocks.1.hook_resid_pre"])
    eps = 1e-6

    def shifted(sign: float) -> float:
        o = run_with_hooks(model, ids[None], hooks={
            "blocks.1.hook_resid_pre": lambda t, n: t + sign * eps * direction})
        return float(o.logits[0, -1, 3])
    numeric = (shifted(1) - shifted(-1)) / (2 * eps)
    analytic = float((cache["blocks.1.hook_resid_pre_grad"] * direction).sum())
    assert analytic == pytest.approx(numeric, rel=1e-6)
    assert all(p.grad is None for p in model.parameters())  # parameters untouched
    with pytest.raises(ValueError, match="incl_bwd"):
        run_with_cache(model, ids[None], names=names, incl_bwd=True)


def test_graph_files_that_would_allocate_too_much_are_refused(tmp_path) -> None:
    node = {"node_id": "E_5_1000000000", "feature_type": "embedding", "ctx_idx": 10 ** 9,
            "layer": "E", "feature": 0}
    (tmp_path / "huge.json").write_text(json.dumps({"nodes": [node], "links": []}))
    with pytest.raises(GraphFileError, match="huge.json: 0 layers x 1000000001 positions"):
        load_graph_json(tmp_path / "huge.json")
    node = dict(node, node_id="nonsense", ctx_idx=1)
    (tmp_path / "odd.json").write_text(json.dumps({"nodes": [node], "links": []}))
    with pytest.raises(GraphFileError, match=r"odd.json: nodes\[0\]: node_id 'nonsense'"):
        load_graph_json(tmp_path / "odd.json")
