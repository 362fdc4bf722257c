/* handformer serve: the attribution graph (--graph FILE.json, --transcoders PATH). The graph
   is drawn by the graph view (/static/graph.js, window.hfGraph: the same script a page saved
   by save_graph_html inlines); this part lists the graphs, asks the server to graph the text
   (one at a time, with the seconds it has been computing) and fetches the feature cards. */

let graphInfo = null;   // GET /api/graph
let graphShown = null;  // the id of the graph drawn
let graphSeq = 0;

function graphStatus(text, isError) {
  const s = $("sv-graph-status");
  s.textContent = text || "";
  s.classList.toggle("sv-error", !!isError);
}

function fillGraphs(list, chosen) {
  const pick = $("sv-graph-pick");
  pick.textContent = "";
  list.forEach(function (g) {
    const o = el("option", null, g.id + " \u00b7 " + g.source.slice(0, 60) + " \u00b7 " + g.features + " features");
    o.value = g.id;
    pick.appendChild(o);
  });
  if (chosen) pick.value = chosen;
  $("sv-graph-pick-box").hidden = list.length < 2;
}

async function loadGraphs() {
  try {
    graphInfo = await getJSON("/api/graph");
  } catch (err) {
    graphInfo = null;
  }
  const box = $("sv-graph-box");
  box.hidden = !graphInfo || (!graphInfo.graphs.length && !graphInfo.compute);
  if (box.hidden) return;
  $("sv-graph-compute-box").hidden = !graphInfo.compute;
  if (graphInfo.compute) {
    $("sv-graph-max").value = String(graphInfo.limits.default_feature_nodes);
    $("sv-graph-max").max = String(graphInfo.limits.max_feature_nodes);
  }
  $("sv-graph-pick").addEventListener("change", function (e) { showGraph(e.target.value); });
  $("sv-graph-run").addEventListener("click", computeGraph);
  const list = graphInfo.graphs;
  fillGraphs(list, list.length ? list[list.length - 1].id : null);
  if (list.length) await showGraph(list[list.length - 1].id);
  else graphStatus("type a prompt above, then Graph the text");
}

function graphCard(id) {
  if (!graphInfo.cards) return null;
  return function (node) {
    return post("/api/graph/card", { model: graphInfo.model, graph: id, layer: node.layer, feature: node.feature });
  };
}

function mountGraph(id, data) {
  graphShown = id;
  window.hfGraph.mount($("sv-graph"), data, { card: graphCard(id) });
  document.body.dataset.svGraph = id;
  count("svGraphs");
}

async function showGraph(id) {
  const my = ++graphSeq;
  graphStatus("loading " + id + "\u2026");
  try {
    const data = await getJSON("/api/graph/view?graph=" + encodeURIComponent(id));
    if (my !== graphSeq) return;
    mountGraph(id, data);
    graphStatus("");
  } catch (err) {
    if (my === graphSeq) graphStatus(id + ": " + err.message, true);
  }
}

async function computeGraph() {
  const body = { model: graphInfo.model, text: $("sv-text").value,
                 max_feature_nodes: +$("sv-graph-max").value };
  const target = $("sv-graph-target").value;
  if (target) body.target = target;
  const my = ++graphSeq, started = Date.now(), run = $("sv-graph-run");
  run.disabled = true;
  document.body.dataset.svGraphComputing = "1";
  const tick = function () {
    graphStatus("computing the graph\u2026 " + Math.round((Date.now() - started) / 1000) + " s");
  };
  tick();
  const timer = setInterval(tick, 1000);
  try {
    const r = await post("/api/graph/compute", body);
    const list = (await getJSON("/api/graph")).graphs;
    if (my !== graphSeq) return;
    fillGraphs(list, r.graph.id);
    mountGraph(r.graph.id, r.view);
    graphStatus("computed in " + r.graph.seconds.toFixed(1) + " s: " + r.graph.features + " features, " +
      r.graph.nodes + " nodes" + (r.notices.length ? " \u00b7 " + r.notices.join(" ") : ""));
  } catch (err) {
    if (my === graphSeq) graphStatus(err.message, true);
  } finally {
    clearInterval(timer);
    run.disabled = false;
    document.body.dataset.svGraphComputing = "";
  }
}
