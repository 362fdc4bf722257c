/* handformer attribution-graph view, part 2: the controls around the drawing (thresholds,
   how many edges, grouping), hover cards, selection with the strongest paths, supernodes,
   the JSON export, mount() and the start-up of a page saved by save_graph_html. */

const DEFAULT_EDGES = 300;
const views = [];

function slider(parent, label, min, max, step, value, title) {
  const box = parent.appendChild(hel("label", "gv-slider"));
  box.title = title;
  box.appendChild(hel("span", null, label + " "));
  const input = box.appendChild(hel("input"));
  input.type = "range"; input.min = String(min); input.max = String(max);
  input.step = String(step); input.value = String(value);
  const out = box.appendChild(hel("output", null, String(value)));
  return { input: input, out: out };
}

function button(parent, text, role, title) {
  const b = parent.appendChild(hel("button", null, text));
  b.type = "button";
  b.dataset.role = role;
  if (title) b.title = title;
  return b;
}

function legend(parent) {
  const p = parent.appendChild(hel("p", "gv-legend muted"));
  [["feature", "feature"], ["error", "error node (what the transcoder misses)"],
   ["embedding", "token embedding"], ["logit", "logit"], ["super", "supernode"]].forEach(function (k) {
    const s = sel("svg", { width: 22, height: 20, class: "gv-key" });
    const g = sel("g", { class: "gv-keynode gv-" + k[0] }, s);
    shapeOf({ kind: k[0], x: 11, y: 11 }, g);
    p.appendChild(s);
    p.appendChild(hel("span", null, k[1] + "  "));
  });
  p.appendChild(hel("span", "gv-pos", "\u2014 positive"));
  p.appendChild(hel("span", null, " / "));
  p.appendChild(hel("span", "gv-neg", "\u2014 negative"));
  p.appendChild(hel("span", null, " direct effect (width and opacity by |weight|). Hover a node for " +
    "its card; click to select it and light its strongest paths; shift-click nodes, then Group, " +
    "to make a supernode."));
}

// ---- cards --------------------------------------------------------------------------------
function tokenRow(box, label, list) {
  const p = box.appendChild(hel("p", null, label + " "));
  (list || []).forEach(function (t) {
    p.appendChild(hel("span", "gv-chip", t.token + " " + (t.value >= 0 ? "+" : "") + t.value.toFixed(2)));
  });
}

// A feature card as /api/features/card answers it: contexts (the token marked), density,
// the tokens its decoder row promotes and suppresses.
function featureCard(box, r) {
  box.appendChild(hel("p", "muted", "active on " + (100 * r.density).toFixed(2) + "% of " + r.tokens_seen +
    " tokens (" + (r.where || "a built-in sample" + (r.texts_seen ? " and " + r.texts_seen +
    " prompts graphed here" : "")) + ")"));
  const ctx = box.appendChild(hel("div", "gv-contexts"));
  if (!r.contexts.length) ctx.appendChild(hel("p", "muted", "not active in the texts seen"));
  r.contexts.forEach(function (c) {
    const p = ctx.appendChild(hel("p", "gv-context"));
    p.appendChild(hel("span", "muted", c.activation.toFixed(2) + " "));
    p.appendChild(hel("span", null, c.before));
    p.appendChild(hel("mark", null, c.token));
    p.appendChild(hel("span", null, c.after));
  });
  if (r.promoted) {
    tokenRow(box, "promotes:", r.promoted);
    tokenRow(box, "suppresses:", r.suppressed);
  }
}

function edgeList(box, label, list, other) {
  if (!list.length) return;
  const p = box.appendChild(hel("p", "gv-edgelist"));
  p.appendChild(hel("span", "muted", label + " "));
  list.slice(0, 8).forEach(function (e) {
    const it = other(e);
    const c = p.appendChild(hel("span", "gv-chip " + (e.w > 0 ? "gv-pos" : "gv-neg"),
      (it.kind === "super" ? it.name : it.node.label + " @" + it.node.pos) + " " +
      (e.w > 0 ? "+" : "") + num(e.w)));
    c.dataset.key = it.key;
  });
}

function describe(V, it) {
  const G = V.G;
  if (it.kind === "super") {
    const ins = V.set.edges.filter(function (e) { return e.t === it; }).length;
    const outs = V.set.edges.filter(function (e) { return e.s === it; }).length;
    return ["Supernode \u201c" + it.name + "\u201d: " + it.members.length + " nodes (" +
      it.members.map(function (m) { return G.nodes[m].label + " @" + G.nodes[m].pos; }).join(", ") + ")",
      "Collapsed: each edge is the sum of its members' edges kept by pruning with that node (" +
      ins + " in, " + outs + " out); the " + it.internal.count + " kept edges between its members" +
      (it.internal.count ? " (sum " + num(it.internal.sum) + ")" : "") + " are not drawn."];
  }
  const n = it.node, tok = G.tokens[n.pos] === undefined ? "" : " \u201c" + G.tokens[n.pos] + "\u201d";
  const where = "position " + n.pos + tok;
  const infl = "influence on the logits " + num(V.pruned.influence[n.i]);
  if (n.kind === "feature") {
    return ["Feature " + n.feature + " of layer " + n.layer + ", " + where,
            "activation " + num(n.act) + " \u00b7 " + infl + (n.clerp ? " \u00b7 " + n.clerp : "")];
  }
  if (n.kind === "error") {
    return ["Error node of layer " + n.layer + ", " + where,
            "what layer " + n.layer + "'s transcoder misses of its MLP's output there (and the " +
            "features left out of the graph) \u00b7 " + infl];
  }
  if (n.kind === "embedding") return ["Token embedding, " + where, "token id " + n.feature + " \u00b7 " + infl];
  return ["Logit " + n.label + " (token id " + n.feature + ") at position " + n.pos,
          "probability " + num(n.prob) + (n.clerp ? " \u00b7 " + n.clerp : "")];
}

function cardOf(V, n) {
  const key = n.layer + "_" + n.feature;
  if (!V.cards.has(key)) {
    let p = Promise.resolve(V.G.cards[key] || null);
    if (!V.G.cards[key] && V.options.card) p = Promise.resolve(V.options.card(n));
    V.cards.set(key, p.catch(function (err) { V.cards.delete(key); throw err; }));
  }
  return V.cards.get(key);
}

function showCard(V, key) {
  const panel = V.panel, it = key === null ? null : V.byKey.get(key);
  panel.textContent = "";
  panel.dataset.key = it ? key : "";
  panel.dataset.state = it ? "node" : "";
  if (!it) {
    panel.appendChild(hel("p", "muted", "Hover a node for its card."));
    return;
  }
  const lines = describe(V, it);
  panel.appendChild(hel("h4", null, lines[0]));
  panel.appendChild(hel("p", "muted", lines[1]));
  edgeList(panel, "strongest inputs:", V.set.edges.filter(function (e) { return e.t === it; }),
           function (e) { return e.s; });
  edgeList(panel, "strongest outputs:", V.set.edges.filter(function (e) { return e.s === it; }),
           function (e) { return e.t; });
  if (it.kind !== "feature") return;
  const box = panel.appendChild(hel("div", "gv-feature-card"));
  if (!V.options.card && !V.G.cards[it.node.layer + "_" + it.node.feature]) {
    box.appendChild(hel("p", "muted", "no card: the top contexts and logit effects need the " +
      "transcoders (handformer serve --transcoders, or save_graph_html(..., cards=...))"));
    return;
  }
  box.appendChild(hel("p", "muted", "loading the card\u2026"));
  cardOf(V, it.node).then(function (card) {
    if (panel.dataset.key !== key) return;
    box.textContent = "";
    if (!card) { box.appendChild(hel("p", "muted", "no card for this feature")); return; }
    featureCard(box, card);
    panel.dataset.state = "card";
    document.body.dataset.gvCards = String(+(document.body.dataset.gvCards || 0) + 1);
  }, function (err) {
    if (panel.dataset.key === key) box.textContent = "card: " + err.message;
  });
}

// ---- selection: the strongest paths through a node ----------------------------------------
// The three strongest drawn edges into the node, each followed back by the strongest edge
// into its source, down to the embeddings; the same forward, up to the logits.
function pathsThrough(V, key) {
  const inc = new Map(), out = new Map();
  V.drawn.shown.forEach(function (e) {
    if (!inc.has(e.t.key)) inc.set(e.t.key, []);
    if (!out.has(e.s.key)) out.set(e.s.key, []);
    inc.get(e.t.key).push(e);
    out.get(e.s.key).push(e);
  });
  const nodes = new Set([key]), edges = new Set();
  function follow(map, end, start) {
    (map.get(start) || []).slice(0, 3).forEach(function (first) {
      let e = first;
      while (e && !edges.has(e)) {
        edges.add(e);
        const next = end(e);
        nodes.add(next.key);
        e = (map.get(next.key) || [])[0];
      }
    });
  }
  follow(inc, function (e) { return e.s; }, key);
  follow(out, function (e) { return e.t; }, key);
  return { nodes: nodes, edges: edges };
}

function highlight(V) {
  const on = V.selected === null ? null : pathsThrough(V, V.selected);
  V.root.classList.toggle("gv-focus", !!on);
  V.drawn.nodes.forEach(function (g, key) {
    g.classList.toggle("gv-on", !!on && on.nodes.has(key));
    g.classList.toggle("gv-selected", key === V.selected);
    g.classList.toggle("gv-picked", V.picked.has(key));
  });
  V.drawn.shown.forEach(function (e) { e.el.classList.toggle("gv-on", !!on && on.edges.has(e)); });
  V.root.dataset.path = on ? String(on.edges.size) : "";
}

// ---- supernodes ---------------------------------------------------------------------------
function note(V, text) {
  V.note.textContent = text || "";
}

function group(V) {
  const keys = Array.from(V.picked).filter(function (k) { return V.G.index.has(k); });
  if (keys.length < 2) { note(V, "shift-click two nodes or more first"); return false; }
  const members = keys.map(function (k) { return V.G.index.get(k); });
  const taken = V.supers.find(function (s) { return members.some(function (m) { return s.members.indexOf(m) >= 0; }); });
  if (taken) { note(V, "a node is already in \u201c" + taken.name + "\u201d; ungroup it first"); return false; }
  const name = V.nameInput.value.trim() || "group " + (V.supers.length + 1);
  if (V.supers.some(function (s) { return s.name === name; })) {
    note(V, "there is already a supernode \u201c" + name + "\u201d"); return false;
  }
  V.supers.push({ name: name, members: members, collapsed: true });
  V.picked.clear();
  V.nameInput.value = "";
  note(V, "");
  render(V, false);
  return true;
}

function listSupers(V) {
  const box = V.superList;
  box.textContent = "";
  V.supers.forEach(function (s, k) {
    const row = box.appendChild(hel("div", "gv-super-row"));
    row.appendChild(hel("b", null, s.name));
    row.appendChild(hel("span", "muted", " " + s.members.length + " nodes "));
    const t = button(row, s.collapsed ? "Expand" : "Collapse", "toggle");
    t.addEventListener("click", function () { s.collapsed = !s.collapsed; render(V, false); });
    const u = button(row, "Ungroup", "ungroup");
    u.addEventListener("click", function () { V.supers.splice(k, 1); render(V, false); });
  });
}

// The graph file with the supernodes made here (circuit-tracer's qParams.supernodes; their
// members as pinnedIds), as an object; saveJSON() downloads it.
function exportJSON(V) {
  const data = V.G.data, out = {};
  Object.keys(data).forEach(function (k) { if (k !== "view") out[k] = data[k]; });
  const groups = V.supers.map(function (s) {
    return [s.name].concat(s.members.map(function (m) { return V.G.nodes[m].id; }));
  });
  const pinned = [];
  groups.forEach(function (g) { g.slice(1).forEach(function (id) { if (pinned.indexOf(id) < 0) pinned.push(id); }); });
  out.metadata = Object.assign({}, data.metadata || {}, { node_threshold: V.nodeTh });
  out.qParams = Object.assign({}, data.qParams || {}, { supernodes: groups, pinnedIds: pinned });
  return out;
}

function saveJSON(V) {
  const blob = new Blob([JSON.stringify(exportJSON(V))], { type: "application/json" });
  const a = hel("a");
  a.href = URL.createObjectURL(blob);
  a.download = V.G.slug + ".json";
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(function () { URL.revokeObjectURL(a.href); }, 1000);
}

// ---- rendering ----------------------------------------------------------------------------
function render(V, reprune) {
  const G = V.G;
  if (reprune || !V.pruned) V.pruned = prune(G, V.nodeTh, V.edgeTh);
  V.set = drawSet(G, V.pruned, V.supers);
  V.byKey = new Map(V.set.items.map(function (it) { return [it.key, it]; }));
  const total = V.set.edges.length;
  if (V.maxEdges === null) V.maxEdges = Math.min(total, DEFAULT_EDGES);
  const shown = Math.min(V.maxEdges, total);
  V.edgesCtl.input.max = String(total);
  V.edgesCtl.input.value = String(shown);
  V.edgesCtl.out.textContent = shown + " of " + total;
  V.drawn = draw(V.svg, G, V.set, shown);
  if (V.selected !== null && !V.byKey.has(V.selected)) V.selected = null;
  V.picked.forEach(function (k) { if (!V.byKey.has(k)) V.picked.delete(k); });
  highlight(V);
  listSupers(V);
  let kept = 0, keptEdges = 0;
  V.pruned.nodes.forEach(function (m) { kept += m; });
  V.pruned.edges.forEach(function (m) { keptEdges += m; });
  V.counts.textContent = kept + " of " + G.nodes.length + " nodes and " + keptEdges + " of " +
    G.edges.length + " edges kept" + (G.edgesTotal > G.edges.length ? " (the page holds the " +
    G.edges.length + " strongest of the graph's " + G.edgesTotal + " edges)" : "");
  V.groupBtn.disabled = V.picked.size < 2;
  V.root.dataset.nodes = String(V.set.items.length);
  V.root.dataset.edges = String(V.drawn.shown.length);
  V.root.dataset.supernodes = String(V.supers.length);
  V.root.dataset.renders = String(+(V.root.dataset.renders || 0) + 1);
  showCard(V, V.selected);
}

function nodeKey(e) {
  const g = e.target.closest ? e.target.closest(".gv-node") : null;
  return g && g.dataset.key !== undefined ? g.dataset.key : null;
}

function wire(V) {
  V.svg.addEventListener("mouseover", function (e) {
    const key = nodeKey(e);
    if (key !== null && key !== V.panel.dataset.key) showCard(V, key);
  });
  V.svg.addEventListener("mouseleave", function () { showCard(V, V.selected); });
  V.svg.addEventListener("focusin", function (e) { const key = nodeKey(e); if (key !== null) showCard(V, key); });
  V.svg.addEventListener("click", function (e) {
    const key = nodeKey(e);
    if (key !== null && e.shiftKey) {
      if (V.picked.has(key)) V.picked.delete(key); else V.picked.add(key);
      V.groupBtn.disabled = V.picked.size < 2;
      note(V, V.picked.size ? V.picked.size + " picked" : "");
    } else V.selected = key === V.selected ? null : key;
    highlight(V);
    showCard(V, V.selected === null ? key : V.selected);
  });
  V.svg.addEventListener("keydown", function (e) {
    const key = nodeKey(e);
    if (key === null || (e.key !== "Enter" && e.key !== " ")) return;
    e.preventDefault();
    V.selected = key === V.selected ? null : key;
    highlight(V);
    showCard(V, key);
  });
  V.panel.addEventListener("click", function (e) {
    const c = e.target.closest("[data-key]");
    if (c && c !== V.panel && V.byKey.has(c.dataset.key)) {
      V.selected = c.dataset.key;
      highlight(V);
      showCard(V, V.selected);
    }
  });
  V.nodeCtl.input.addEventListener("input", function () {
    V.nodeTh = +V.nodeCtl.input.value; V.nodeCtl.out.textContent = V.nodeTh.toFixed(2); render(V, true);
  });
  V.edgeCtl.input.addEventListener("input", function () {
    V.edgeTh = +V.edgeCtl.input.value; V.edgeCtl.out.textContent = V.edgeTh.toFixed(3); render(V, true);
  });
  V.edgesCtl.input.addEventListener("input", function () { V.maxEdges = +V.edgesCtl.input.value; render(V, false); });
  V.groupBtn.addEventListener("click", function () { group(V); });
  V.clearBtn.addEventListener("click", function () { V.picked.clear(); V.selected = null; note(V, ""); render(V, false); });
  V.saveBtn.addEventListener("click", function () { saveJSON(V); });
}

// Show `data` (a graph file, with the view's extras under data.view) in `root`. options.card:
// a function (node) -> a card or a promise of one (the server's), else the cards in the data.
function mount(root, data, options) {
  const G = prepare(data);
  const V = { G: G, root: root, options: options || {}, nodeTh: G.thresholds.node,
              edgeTh: G.thresholds.edge, maxEdges: null, pruned: null, supers: [],
              picked: new Set(), selected: null, cards: new Map() };
  (data.qParams && data.qParams.supernodes || []).forEach(function (g) {
    const members = g.slice(1).map(function (id) { return G.index.get(id); })
      .filter(function (m) { return m !== undefined; });
    if (members.length) V.supers.push({ name: String(g[0]), members: members, collapsed: true });
  });
  root.textContent = "";
  root.classList.add("gv");
  const head = root.appendChild(hel("div", "gv-head"));
  head.appendChild(hel("strong", null, G.slug + " "));
  const sc = G.scores;
  head.appendChild(hel("span", "gv-scores", sc ? "replacement score " + num(sc.replacement) +
    " \u00b7 completeness score " + num(sc.completeness) + " (of the whole graph) " : ""));
  V.counts = head.appendChild(hel("span", "muted gv-counts"));
  const ctl = root.appendChild(hel("div", "gv-controls"));
  V.nodeCtl = slider(ctl, "node threshold", 0.05, 1, 0.01, V.nodeTh,
    "keep the nodes that carry this share of the influence on the logits (embeddings and logits always)");
  V.edgeCtl = slider(ctl, "edge threshold", 0.5, 1, 0.001, V.edgeTh,
    "keep the edges that carry this share of the influence between the kept nodes");
  V.edgesCtl = slider(ctl, "edges drawn", 0, 1, 1, 0, "draw the strongest of the kept edges (by |weight|)");
  const grp = root.appendChild(hel("div", "gv-controls"));
  V.nameInput = grp.appendChild(hel("input"));
  V.nameInput.type = "text";
  V.nameInput.placeholder = "supernode name";
  V.nameInput.dataset.role = "name";
  V.groupBtn = button(grp, "Group picked", "group", "group the shift-clicked nodes into one supernode (collapsed)");
  V.clearBtn = button(grp, "Clear selection", "clear");
  V.saveBtn = button(grp, "Save JSON", "save", "download the graph file with the supernodes (circuit-tracer / Neuronpedia JSON)");
  V.note = grp.appendChild(hel("span", "muted gv-note"));
  V.superList = root.appendChild(hel("div", "gv-supers"));
  const body = root.appendChild(hel("div", "gv-body"));
  const canvas = body.appendChild(hel("div", "gv-canvas"));
  V.svg = sel("svg", { class: "gv-svg", role: "img", "aria-label": "attribution graph" }, canvas);
  V.panel = body.appendChild(hel("aside", "gv-card"));
  V.panel.setAttribute("aria-live", "polite");
  legend(root);
  wire(V);
  render(V, true);
  const api = { state: V, exportJSON: function () { return exportJSON(V); },
                group: function () { return group(V); }, render: function () { render(V, true); } };
  views.push(api);
  return api;
}

window.hfGraph = { mount: mount, prepare: prepare, prune: prune, drawSet: drawSet, views: views };

// A page saved by save_graph_html: the graph in #hf-graph-data, drawn into #hf-graph.
(function start() {
  const src = document.getElementById("hf-graph-data"), root = document.getElementById("hf-graph");
  if (!src || !root) return;
  try {
    mount(root, JSON.parse(src.textContent));
    document.body.dataset.ready = "1";
  } catch (err) {
    root.textContent = "cannot show this graph: " + err.message;
    document.body.dataset.ready = "error";
  }
})();
