"""The attribution-graph view's data and API (``handformer serve --graph / --transcoders``):
a tiny causal LM and tiny transcoders the test writes. The graph the server sends is checked
against ``attribution_graph``'s own adjacency (computed here, in the test), and a hand-made
graph's file round trip keeps its supernodes."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from handformer.features import (  # noqa: E402
    AttributionGraph,
    Transcoder,
    attribution_graph,
    feature_logit_effects,
    graph_feature_cards,
    graph_view_data,
    load_graph_json,
    load_transcoder_set,
    save_dictionary,
    save_graph_html,
    save_graph_json,
)
from handformer.features.files import DictionaryFileError  # noqa: E402
from handformer.serve import ModelState, create_app, graph_routes  # noqa: E402
from handformer.serve.graph import GraphSet  # noqa: E402
from serve_util import causal_folder  # noqa: E402

TEXT = "the cat sat on"


def tiny_transcoder(layer: int, d: int = 32, *, seed: int = 3) -> Transcoder:
    torch.manual_seed(seed + layer)
    tc = Transcoder(d, 16, hook_name=f"blocks.{layer}.mlp.hook_in",
                    output_hook_name=f"blocks.{layer}.hook_mlp_out")
    with torch.no_grad():
        tc.W_enc.normal_(0, 0.5)
        tc.b_enc.fill_(-0.1)
        tc.W_dec.normal_(0, 0.3)
    return tc


def hand_graph() -> AttributionGraph:
    """Seven nodes: features L0 F3 @0 and L0 F5 @1, two error nodes, two embeddings, one
    logit; edges chosen by hand (targets x sources)."""
    A = torch.zeros(7, 7, dtype=torch.float64)
    A[0, 4] = 0.5     # f0 <- emb0
    A[1, 5] = 1.0     # f1 <- emb1
    A[1, 4] = -0.25   # f1 <- emb0
    A[1, 0] = 0.75    # f1 <- f0 (inside the group below)
    A[6, 0] = 2.0     # logit <- f0
    A[6, 1] = -1.0    # logit <- f1
    A[6, 3] = 0.5     # logit <- err L0 @1
    A[6, 5] = 0.25    # logit <- emb1
    nan = torch.full((7,), float("nan"), dtype=torch.float64)
    g = AttributionGraph(torch.tensor([11, 12]), 1, torch.tensor([[0, 0, 3], [0, 1, 5]]),
                         torch.tensor([1.0, 2.0]), torch.tensor([7]), torch.tensor([-1]),
                         torch.tensor([1.0], dtype=torch.float64), 1, A, nan, nan.clone())
    g.replacement_score, g.completeness_score = g.scores()
    return g


def dense(view: dict) -> tuple[list[str], torch.Tensor]:
    """The adjacency a view's links spell out, in its nodes' order."""
    ids = [n["node_id"] for n in view["nodes"]]
    where = {n: i for i, n in enumerate(ids)}
    A = torch.zeros(len(ids), len(ids), dtype=torch.float64)
    for link in view["links"]:
        A[where[link["target"]], where[link["source"]]] = link["weight"]
    return ids, A


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph")
    folder = causal_folder(root / "model")
    state = ModelState(str(folder))
    for i in range(2):  # a train-sae run's layout: dictionaries/HOOK/
        save_dictionary(tiny_transcoder(i), root / "run" / "dictionaries" /
                        f"blocks.{i}.hook_mlp_out")
    tcs = load_transcoder_set(root / "run", n_layers=2)
    ids = torch.tensor(state.tokenizer.encode("the dog ran"))
    file_graph = attribution_graph(state.model, tcs, ids, max_feature_nodes=6)
    f0 = "_".join(map(str, (file_graph.features[0, 0].item(), file_graph.features[0, 2].item(),
                            file_graph.features[0, 1].item())))
    path = save_graph_json(file_graph, root / "dog.json", supernodes=[["first", f0, "0_-1_1"]])
    graphs = GraphSet(state, tcs, [("dog.json", load_graph_json(path))])
    with TestClient(create_app(state, graphs=graphs)) as client:
        yield client, state, tcs, file_graph, root


def test_transcoder_set_layouts(setup, tmp_path):
    _, _, tcs, _, root = setup
    assert [t.W_dec.data_ptr() != 0 for t in tcs] == [True, True]
    assert torch.equal(tcs[1].W_enc, tiny_transcoder(1).W_enc)  # layer from the hook names
    save_dictionary(tiny_transcoder(1), tmp_path / "layer_b")  # a folder of layers, one left out
    got = load_transcoder_set(tmp_path, n_layers=3)
    assert got[0] is None and got[2] is None and torch.equal(got[1].W_enc, tcs[1].W_enc)
    save_dictionary(tiny_transcoder(1, seed=9), tmp_path / "layer_c")
    with pytest.raises(DictionaryFileError, match="layer_c: a second transcoder for layer 1"):
        load_transcoder_set(tmp_path)
    with pytest.raises(DictionaryFileError, match="a transcoder of layer 1, the model has 1"):
        load_transcoder_set(tmp_path / "layer_b", n_layers=1)
    with pytest.raises(DictionaryFileError, match="model.safetensors: no 'handformer.dictionary'"):
        load_transcoder_set(root / "model")  # a model's folder: named, not skipped
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no transcoders found"):
        load_transcoder_set(tmp_path / "empty")


def test_computed_graph_is_attribution_graphs_own(setup):
    client, state, tcs, _, _ = setup
    info = client.get("/api/graph").json()
    assert info["compute"] and info["model"] == state.name
    r = client.post("/api/graph/compute", json={"text": TEXT, "max_feature_nodes": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    view = body["view"]
    ids = torch.tensor(state.tokenizer.encode(TEXT))
    want = attribution_graph(state.model, tcs, ids, max_feature_nodes=12)  # the reference
    got_ids, A = dense(view)
    assert len(got_ids) == want.adjacency.shape[0]
    assert torch.allclose(A, want.adjacency.double(), rtol=1e-6, atol=1e-9)
    assert (A != 0).sum() == (want.adjacency != 0).sum() == view["view"]["edges_total"]
    assert view["view"]["row_abs"] == pytest.approx(want.adjacency.abs().sum(1).tolist(),
                                                    rel=1e-6)
    assert view["view"]["scores"]["replacement"] == pytest.approx(want.replacement_score,
                                                                  rel=1e-5)
    shown = {" ": "\u2423"}  # the page's label of a space
    assert view["metadata"]["prompt_tokens"] == [shown.get(c, c) for c in TEXT]
    logit_labels = view["view"]["labels"][-len(want.logit_tokens):]
    assert logit_labels == [shown.get(c, c) for c in
                            (state.tokenizer.decode([int(t)]) for t in want.logit_tokens)]
    listed = client.get("/api/graph").json()["graphs"]
    assert [g["id"] for g in listed] == ["file-1", body["graph"]["id"]]
    again = client.get(f"/api/graph/view?graph={body['graph']['id']}").json()
    assert again["links"] == view["links"]


def test_named_target_and_bad_bodies(setup, monkeypatch):
    client, state, tcs, _, _ = setup
    r = client.post("/api/graph/compute", json={"text": TEXT, "target": "a",
                                                "max_feature_nodes": 0}).json()
    a = state.tokenizer.encode("a", add_special_tokens=False)[0]
    logits = [n for n in r["view"]["nodes"] if n["feature_type"] == "logit"]
    assert [n["feature"] for n in logits] == [a]
    assert r["graph"]["features"] == 0  # max_feature_nodes=0: every feature joins an error
    monkeypatch.setattr(graph_routes, "MAX_GRAPH_TOKENS", 8)
    for body, field, text in (
            ({"text": "cat", "target": "ab"}, "target", '"ab" is 2 tokens'),
            ({"text": "cat", "target": 99}, "target", "token id 99 is not in 0..30"),
            ({"text": "cat", "max_feature_nodes": -1}, "max_feature_nodes", "must be in 0..4096"),
            ({"text": "a" * 9}, "text", "9 tokens; a graph takes at most 8"),
            ({"ids": [1] * 9}, "ids", "9 tokens; a graph takes at most 8"),
            ({"text": "cat", "layers": 1}, "layers", "unknown field")):
        res = client.post("/api/graph/compute", json=body)
        assert res.status_code == 422 and res.json()["field"] == field, res.text
        assert text in res.json()["error"]
    res = client.get("/api/graph/view?graph=nope")
    assert res.status_code == 422 and "no graph 'nope'; graphs: file-1" in res.json()["error"]
    res = client.post("/api/graph/card", json={"layer": 0, "feature": 16})
    assert res.status_code == 422 and "must be in 0..15" in res.json()["error"]


def test_card_reads_the_transcoder_at_the_mlp_input(setup):
    client, state, tcs, _, _ = setup
    client.post("/api/graph/compute", json={"text": TEXT, "max_feature_nodes": 4})
    # reference: the MLP input read with a hook of its own, encoded by the transcoder
    ids = state.tokenizer.encode(TEXT)
    seen = {}
    h = state.model.blocks[1].mlp.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("x", a[0].detach()))
    try:
        with torch.no_grad():
            state.model(input_ids=torch.tensor([ids]))
    finally:
        h.remove()
    acts = tcs[1].encode(seen["x"][0])  # (L, F)
    f = int(acts[1:].max(0).values.argmax())
    pos = int(acts[1:, f].argmax()) + 1
    card = client.post("/api/graph/card", json={"layer": 1, "feature": f}).json()
    assert card["texts_seen"] >= 1
    top = [c for c in card["contexts"] if c["source"] == "seen"][0]
    assert top["activation"] == pytest.approx(float(acts[pos, f]), abs=1e-3)
    assert top["token"] == state.tokenizer.decode([ids[pos]])
    assert card["promoted"] and len(card["promoted"]) == 10


def test_file_graph_is_served_with_its_supernodes(setup):
    client, _, _, file_graph, _ = setup
    view = client.get("/api/graph/view?graph=file-1").json()
    _, A = dense(view)
    assert torch.allclose(A, file_graph.adjacency.double(), rtol=1e-6, atol=1e-7)
    group = view["qParams"]["supernodes"][0]
    assert group[0] == "first" and group[2] == "0_-1_1"
    assert view["qParams"]["pinnedIds"] == group[1:]


def test_hand_made_view_data_and_html(tmp_path):
    g = hand_graph()
    data = graph_view_data(g, prompt_tokens=["a", "b"], logit_tokens=[" c"],
                           supernodes=[["pair", "0_3_0", "0_5_1"]], node_threshold=0.5)
    ids, A = dense(data)
    assert ids == ["0_3_0", "0_5_1", "0_-1_0", "0_-1_1", "E_11_0", "E_12_1", "2_7_1"]
    assert torch.equal(A, g.adjacency)
    assert data["view"]["row_abs"] == [0.5, 2.0, 0.0, 0.0, 0.0, 0.0, 3.75]
    assert data["view"]["labels"] == [None] * 6 + [" c"]
    assert data["view"]["thresholds"] == {"node": 0.5, "edge": 0.98}
    # max_edges keeps the edges carrying most influence: f0 <- emb0 is all of f0's input,
    # and f0's influence is 2/3.75 + (1/3.75)(0.75/2) = 0.633, more than logit <- f0's
    # share of the logit's input, 2/3.75 = 0.533 (times the logit's weight 1)
    one = graph_view_data(g, max_edges=1)
    assert [(x["target"], x["source"]) for x in one["links"]] == [("0_3_0", "E_11_0")]
    assert one["view"]["edges_total"] == 8 and one["view"]["row_abs"][6] == 3.75
    path = save_graph_html(g, tmp_path / "g.html", supernodes=[["pair", "0_3_0", "0_5_1"]])
    page = path.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)|@import|url\(""", page)
    assert '"supernodes":[["pair","0_3_0","0_5_1"]]' in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.html"]  # no temporary file left
    with pytest.raises(ValueError, match="path must end in .html or .htm"):
        save_graph_html(g, tmp_path / "g.json")
    with pytest.raises(ValueError, match="supernodes: 'x' and 'pair' both hold '0_3_0'"):
        graph_view_data(g, supernodes=[["pair", "0_3_0", "0_5_1"], ["x", "0_3_0", "E_11_0"]])


def test_graph_file_round_trip_keeps_supernodes_and_tokens(tmp_path):
    g = hand_graph()
    path = save_graph_json(g, tmp_path / "h.json", prompt_tokens=["a", "b"],
                           supernodes=[["pair", "0_3_0", "0_5_1"]])
    back = load_graph_json(path)
    assert back.prompt_tokens == ["a", "b"]
    assert back.supernodes == [["pair", "0_3_0", "0_5_1"]]
    again = json.loads(save_graph_json(back, tmp_path / "h2.json").read_text())
    assert again["qParams"]["supernodes"] == [["pair", "0_3_0", "0_5_1"]]
    assert again["metadata"]["prompt_tokens"] == ["a", "b"]
    data = json.loads(path.read_text())
    data["qParams"]["supernodes"] = [["lost", "9_9_9"]]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad.json: qParams.supernodes: 'lost' names nodes"):
        load_graph_json(tmp_path / "bad.json")


def test_graphs_that_do_not_fit_the_transcoders(setup):
    _, state, tcs, _, _ = setup
    with pytest.raises(ValueError, match="h.json: a graph of 1 layers; the transcoders are for 2"):
        GraphSet(state, tcs, [("h.json", hand_graph())])
    with pytest.raises(ValueError, match=r"transcoders\[0\] has d_in = 8, d_out = 8; the "
                                         "model's MLP input and output have width 32"):
        GraphSet(state, [tiny_transcoder(0, d=8), None])


def test_graph_feature_cards_for_a_saved_page():
    from graph_util import GPT2, tiny

    model, tcs, ids = tiny(GPT2)
    graph = attribution_graph(model, tcs, ids, max_feature_nodes=5)
    torch.manual_seed(0)
    cards = graph_feature_cards(model, tcs, graph, torch.randint(0, 40, (2000,)), tokens=500,
                                nodes=[0, 1], k=3, top_tokens=4)
    want = {f"{layer}_{f}" for layer, _, f in graph.features[:2].tolist()}
    assert set(cards) == want
    for key, card in cards.items():
        layer, f = map(int, key.split("_"))
        values = [c["activation"] for c in card["contexts"]]
        assert 0 < len(values) <= 3 and values == sorted(values, reverse=True)
        assert 0 < card["density"] <= 1 and card["tokens_seen"] > 0
        assert len(card["promoted"]) == len(card["suppressed"]) == 4
        top = [int(t["token"]) for t in card["promoted"]]  # no tokenizer: the ids as text
        assert top == feature_logit_effects(model, tcs[layer], f, k=4).top_ids.tolist()
    with pytest.raises(ValueError, match="nodes: 99 is not a feature node"):
        graph_feature_cards(model, tcs, graph, torch.zeros(100, dtype=torch.long), nodes=[99])


def test_graph_work_runs_on_a_private_module_tree(setup, monkeypatch):
    """The replacement model hooks the MLP modules it is given; another request's forward on
    the served model while those hooks are there must not reach them."""
    from handformer.features import replacement

    client, state, tcs, _, _ = setup
    real = replacement.run_with_cache

    def with_another_request(*args, **kwargs):
        out = real(*args, **kwargs)
        with torch.no_grad():  # what a concurrent /api/run does to the served modules
            state.model(input_ids=torch.tensor([state.tokenizer.encode("zzzz")]))
        return out

    monkeypatch.setattr(replacement, "run_with_cache", with_another_request)
    r = client.post("/api/graph/compute", json={"text": TEXT, "max_feature_nodes": 12})
    monkeypatch.undo()
    assert r.status_code == 200, r.text
    ids = torch.tensor(state.tokenizer.encode(TEXT))
    want = attribution_graph(state.model, tcs, ids, max_feature_nodes=12)
    _, A = dense(r.json()["view"])
    assert torch.allclose(A, want.adjacency.double(), rtol=1e-6, atol=1e-9)


def test_files_only_and_no_graphs_and_one_at_a_time(setup, tmp_path):
    _, state, _, file_graph, root = setup
    files = GraphSet(state, None, [("dog.json", load_graph_json(root / "dog.json"))])
    with TestClient(create_app(state, graphs=files)) as client:
        info = client.get("/api/graph").json()
        assert (info["compute"], info["cards"], [g["id"] for g in info["graphs"]]) == (
            False, False, ["file-1"])
        assert client.get("/api/graph/view").json()["metadata"]["slug"] == "file-1"
        r = client.post("/api/graph/compute", json={"text": TEXT})
        assert r.status_code == 404 and "--transcoders PATH" in r.json()["error"]
        assert client.post("/api/graph/card", json={"layer": 0, "feature": 0}).status_code == 404
    with TestClient(create_app(state)) as client:
        assert client.get("/api/graph").json()["graphs"] == []
        r = client.get("/api/graph/view")
        assert r.status_code == 404 and "handformer serve --graph FILE.json" in r.json()["error"]
    busy = GraphSet(state, [tiny_transcoder(0), tiny_transcoder(1)])
    with TestClient(create_app(state, graphs=busy)) as client:
        busy.busy_since = 0.0
        with busy._busy:  # a graph being computed
            r = client.post("/api/graph/compute", json={"text": TEXT})
        assert r.status_code == 429 and "one at a time" in r.json()["error"]
        assert client.post("/api/graph/compute", json={"text": TEXT}).status_code == 200
