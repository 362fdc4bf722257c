"""The attribution-graph view in headless Chromium: ``handformer serve --model DIR
--transcoders RUN --graph FILE.json`` (a tiny causal LM, transcoders and graph the test
writes), and pages written by ``save_graph_html``. Hovering a feature node shows the card the
API gives; shift-clicking two nodes and grouping them draws one node whose edges are the
hand-computed sums; the page prunes exactly as ``AttributionGraph.prune`` does."""

from __future__ import annotations

import httpx
import pytest
import torch

from graph_util import GPT2, tiny
from handformer.features import (
    attribution_graph,
    load_graph_json,
    load_transcoder_set,
    save_dictionary,
    save_graph_html,
    save_graph_json,
)
from handformer.features.graph_io import node_ids
from handformer.serve import ModelState
from serve_util import Server, causal_folder
from test_serve_graph import hand_graph, tiny_transcoder
from test_viewer_browser import severe, wait_for

pytestmark = pytest.mark.browser

ROOT_JS = "return document.getElementById(arguments[0]).dataset[arguments[1]] || null"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphpage")
    folder = causal_folder(root / "model")
    for i in range(2):
        save_dictionary(tiny_transcoder(i), root / "tcs" / f"layer_{i}")
    state = ModelState(str(folder))
    ids = torch.tensor(state.tokenizer.encode("the dog ran"))
    graph = attribution_graph(state.model, load_transcoder_set(root / "tcs", n_layers=2), ids,
                              max_feature_nodes=8)
    path = save_graph_json(graph, root / "dog.json",
                           prompt_tokens=[state.tokenizer.decode([int(i)]) for i in ids])
    s = Server("--model", str(folder), "--transcoders", str(root / "tcs"), "--graph", str(path))
    yield s
    s.close()


def shift_click(driver, elements) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    chain = ActionChains(driver).key_down(Keys.SHIFT)
    for e in elements:
        chain = chain.click(e)
    chain.key_up(Keys.SHIFT).perform()


def group(driver, root_css: str, name: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, root_css + " [data-role=name]")
    box.send_keys(name)
    driver.find_element(By.CSS_SELECTOR, root_css + " [data-role=group]").click()


def drawn_edges(driver, root_id: str) -> dict[tuple[str, str], float]:
    pairs = driver.execute_script(
        "return Array.from(document.querySelectorAll('#' + arguments[0] + ' path.gv-edge'))"
        ".map(function (p) { return [p.dataset.target, p.dataset.source, p.dataset.weight]; })",
        root_id)
    return {(t, s): float(w) for t, s, w in pairs}


def test_served_graph_hover_card_group_and_compute(driver, server, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver.get_log("browser")
    driver.get(server.url + "/")
    wait_for(driver, "return document.body.dataset.svGraphs || null", "1", timeout=60)
    feats = driver.find_elements(By.CSS_SELECTOR, "#sv-graph .gv-node.gv-feature")
    assert len(feats) >= 2
    key = feats[0].get_attribute("data-key")  # layer_feature_pos
    layer, feature, _ = map(int, key.split("_"))
    ActionChains(driver).move_to_element(feats[0]).perform()
    wait_for(driver, "return document.querySelector('#sv-graph .gv-card').dataset.state", "card",
             timeout=30)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        want = client.post("/api/graph/card", json={"layer": layer, "feature": feature}).json()
    marks = [m.text for m in driver.find_elements(By.CSS_SELECTOR, "#sv-graph .gv-card mark")]
    assert marks == [c["token"].strip() for c in want["contexts"]]  # the activating tokens
    assert want["contexts"]  # the card has contexts to show
    before = int(driver.execute_script(ROOT_JS, "sv-graph", "nodes"))
    a, b = feats[0].get_attribute("data-key"), feats[1].get_attribute("data-key")
    shift_click(driver, feats[:2])
    group(driver, "#sv-graph", "pair")
    wait_for(driver, "return document.getElementById('sv-graph').dataset.supernodes", "1")
    assert int(driver.execute_script(ROOT_JS, "sv-graph", "nodes")) == before - 1
    supers = driver.find_elements(By.CSS_SELECTOR, "#sv-graph .gv-node.gv-super")
    assert [s.get_attribute("data-key") for s in supers] == ["supernode:pair"]
    assert not driver.find_elements(By.CSS_SELECTOR, f'#sv-graph [data-key="{a}"]')
    saved = driver.execute_script("var v = hfGraph.views; return JSON.stringify("
                                  "v[v.length - 1].exportJSON())")
    (tmp_path / "grouped.json").write_text(saved)
    assert load_graph_json(tmp_path / "grouped.json").supernodes == [["pair", a, b]]
    # the prompt typed in: graphed by the server, shown as the second graph
    driver.find_element(By.ID, "sv-graph-run").click()
    wait_for(driver, "return document.body.dataset.svGraphs || null", "2", timeout=60)
    assert driver.execute_script("return document.body.dataset.svGraph") == "computed-2"
    assert "computed in" in driver.find_element(By.ID, "sv-graph-status").text
    assert not severe(driver)


def test_saved_page_collapses_a_supernode_into_summed_edges(driver, tmp_path):
    from selenium.webdriver.common.by import By

    path = save_graph_html(hand_graph(), tmp_path / "hand.html", prompt_tokens=["a", "b"],
                           node_threshold=1.0, edge_threshold=1.0)
    driver.get_log("browser")
    driver.get(path.as_uri())
    wait_for(driver, "return document.body.dataset.ready || null", "1")
    assert len(drawn_edges(driver, "hf-graph")) == 8  # every edge of the hand-made graph
    nodes = {e.get_attribute("data-key"): e for e in
             driver.find_elements(By.CSS_SELECTOR, "#hf-graph .gv-node")}
    nodes["0_5_1"].click()  # its three strongest inputs, followed back, and its output
    lit = driver.execute_script("return Array.from(document.querySelectorAll("
                                "'#hf-graph .gv-node.gv-on')).map(function (g) "
                                "{ return g.dataset.key; })")
    assert sorted(lit) == ["0_3_0", "0_5_1", "2_7_1", "E_11_0", "E_12_1"]
    assert driver.execute_script(ROOT_JS, "hf-graph", "path") == "5"
    shift_click(driver, [nodes["0_3_0"], nodes["0_5_1"]])
    group(driver, "#hf-graph", "pair")
    wait_for(driver, "return document.getElementById('hf-graph').dataset.supernodes", "1")
    S = "supernode:pair"  # sums by hand from hand_graph()'s adjacency
    assert drawn_edges(driver, "hf-graph") == pytest.approx({
        (S, "E_11_0"): 0.5 - 0.25, (S, "E_12_1"): 1.0, ("2_7_1", S): 2.0 - 1.0,
        ("2_7_1", "0_-1_1"): 0.5, ("2_7_1", "E_12_1"): 0.25})
    driver.find_element(By.CSS_SELECTOR, '#hf-graph [data-key="supernode:pair"]').click()
    card = driver.find_element(By.CSS_SELECTOR, "#hf-graph .gv-card").text
    assert "the 1 kept edges between its members (sum 0.750) are not drawn" in card
    driver.find_element(By.CSS_SELECTOR, "#hf-graph [data-role=toggle]").click()  # expand
    assert len(drawn_edges(driver, "hf-graph")) == 8
    assert not severe(driver)


def test_saved_page_prunes_as_python_does(driver, tmp_path):
    model, tcs, ids = tiny(GPT2)
    graph = attribution_graph(model, tcs, ids)  # float64, every active feature
    path = save_graph_html(graph, tmp_path / "tiny.html")
    driver.get(path.as_uri())
    wait_for(driver, "return document.body.dataset.ready || null", "1")
    names = node_ids(graph)
    kept = graph.prune()  # the page opens on the same default thresholds (0.8, 0.98)
    assert int(driver.execute_script(ROOT_JS, "hf-graph", "nodes")) == int(kept.node_mask.sum())
    for nt, et in ((0.5, 0.9), (0.8, 0.98), (0.3, 0.7), (0.95, 0.99)):
        got = driver.execute_script("""
            var G = hfGraph.views[0].state.G, r = hfGraph.prune(G, arguments[0], arguments[1]);
            return [G.nodes.filter(function (n) { return r.nodes[n.i]; })
                      .map(function (n) { return n.id; }),
                    G.edges.filter(function (e, k) { return r.edges[k]; })
                      .map(function (e) { return G.nodes[e.t].id + "<" + G.nodes[e.s].id; })];
            """, nt, et)
        want = graph.prune(node_threshold=nt, edge_threshold=et)
        assert set(got[0]) == {names[i] for i in want.node_mask.nonzero().flatten().tolist()}
        assert set(got[1]) == {f"{names[t]}<{names[s]}" for t, s in
                               want.edge_mask.nonzero().tolist()}
        assert 0 < len(got[1]) < int((graph.adjacency != 0).sum())  # a real cut
