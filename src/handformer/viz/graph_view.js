/* handformer attribution-graph view: circuit-tracer's graph JSON (what
   handformer.features.save_graph_json writes) drawn as layers (rows: token embeddings at the
   bottom, each layer's features and error nodes, the logits on top) x positions (columns, the
   prompt's tokens under them), in SVG. It loads nothing from the network.

   The script is two files, joined in this order inside one function by viz/graph_page.py:
     graph_view.js      the data, pruning by influence (the same steps as
                        handformer.features.influence.prune), supernodes, layout and drawing
     graph_view_ui.js   the controls, hover cards, selection and paths, grouping, export,
                        mount() and the start-up of a saved page
   Text from a graph file is only ever set with textContent. */

const SVG_NS = "http://www.w3.org/2000/svg";
const KIND_OF = { "cross layer transcoder": "feature", "mlp reconstruction error": "error",
                  "embedding": "embedding", "logit": "logit" };
const POS_COLOUR = "#0072B2", NEG_COLOUR = "#D55E00";  // Okabe & Ito: blue +, vermilion -
const ROW_H = 54, SPACING = 16, MIN_COL = 64, LEFT = 56, TOP = 76, BOTTOM = 64;

function hel(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
function sel(tag, attrs, parent) {
  const e = document.createElementNS(SVG_NS, tag);
  Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
  if (parent) parent.appendChild(e);
  return e;
}
function num(x, digits) {
  if (x === null || x === undefined || !isFinite(x)) return "\u2013";
  const a = Math.abs(x);
  return a !== 0 && (a < 1e-3 || a >= 1e4) ? x.toExponential(2) : x.toFixed(digits === undefined ? 3 : digits);
}

// ---- the data -----------------------------------------------------------------------------
// The graph file as the view uses it: nodes with kind, layer (-1: embedding, n_layers:
// logit), position and feature; edges as {t, s, w} over node indices; each node's whole
// input |A[t, :]|.sum() (data.view.row_abs, so a page holding only the strongest edges
// still normalises by the full rows) and its logit weight.
function prepare(data) {
  const view = data.view || {};
  const meta = data.metadata || {};
  const nodes = data.nodes.map(function (n, i) {
    const kind = KIND_OF[n.feature_type] || "feature";
    const parts = String(n.node_id).split("_");
    return { i: i, id: String(n.node_id), kind: kind, rawLayer: String(n.layer),
             pos: +n.ctx_idx, feature: +parts[1],  // a feature's index, or a token id (-1: error)
             act: n.activation === null || n.activation === undefined ? null : +n.activation,
             infl: +(n.influence || 0), prob: kind === "logit" ? +(n.token_prob || 0) : 0,
             clerp: n.clerp || "", label: (view.labels && view.labels[i]) || null };
  });
  let nLayers = view.n_layers;
  if (nLayers === undefined) {
    nLayers = 0;
    nodes.forEach(function (n) {
      if (n.kind === "feature" || n.kind === "error") nLayers = Math.max(nLayers, +n.rawLayer + 1);
    });
  }
  nodes.forEach(function (n) {
    n.layer = n.kind === "embedding" ? -1 : n.kind === "logit" ? nLayers : +n.rawLayer;
    if (!n.label) {
      n.label = n.kind === "feature" ? "L" + n.layer + " #" + n.feature
        : n.kind === "error" ? "error L" + n.layer
        : n.kind === "embedding" ? (meta.prompt_tokens || [])[n.pos] || n.clerp || "token"
        : "logit " + n.feature;  // its clerp (circuit-tracer's text) goes into the card
    }
  });
  const index = new Map(nodes.map(function (n) { return [n.id, n.i]; }));
  const edges = [];
  data.links.forEach(function (l) {
    const t = index.get(String(l.target)), s = index.get(String(l.source));
    if (t !== undefined && s !== undefined && +l.weight !== 0) edges.push({ t: t, s: s, w: +l.weight });
  });
  let rowAbs = view.row_abs;
  if (!rowAbs || rowAbs.length !== nodes.length) {
    rowAbs = new Array(nodes.length).fill(0);
    edges.forEach(function (e) { rowAbs[e.t] += Math.abs(e.w); });
  }
  let L = (meta.prompt_tokens || []).length;
  nodes.forEach(function (n) { L = Math.max(L, n.pos + 1); });
  return { data: data, nodes: nodes, edges: edges, index: index, nLayers: nLayers, L: L,
           tokens: meta.prompt_tokens || [], rowAbs: rowAbs,
           weights: nodes.map(function (n) { return n.prob; }),
           scores: view.scores || null, slug: meta.slug || "graph",
           thresholds: view.thresholds || { node: 0.8, edge: 0.98 },
           edgesTotal: view.edges_total === undefined ? edges.length : view.edges_total,
           cards: view.cards || {} };
}

// ---- pruning (handformer.features.influence, step for step) ---------------------------------
// influence = w (Â + Â² + ...), Â[t, s] = a[e] on the edges: paths from every node to the
// weighted logits. The graph has no cycles, so the series stops.
function influenceOf(n, edges, a, w) {
  let cur = new Float64Array(n);
  const total = new Float64Array(n);
  edges.forEach(function (e, k) { cur[e.s] += w[e.t] * a[k]; });
  for (let iter = 0; iter < 100000; iter++) {
    let any = false;
    for (let i = 0; i < n; i++) { total[i] += cur[i]; if (cur[i] !== 0) any = true; }
    if (!any) return total;
    const next = new Float64Array(n);
    edges.forEach(function (e, k) { if (cur[e.t] !== 0) next[e.s] += cur[e.t] * a[k]; });
    cur = next;
  }
  throw new Error("the graph has a cycle (influence does not converge)");
}

// The largest scores that together hold `threshold` of their sum (and the one crossing it).
function keepCumulative(scores, threshold) {
  const order = Array.from(scores.keys()).sort(function (x, y) { return scores[y] - scores[x]; });
  let total = 0;
  for (let i = 0; i < scores.length; i++) total += scores[i];
  total = Math.max(total, 1e-30);
  let cum = 0, below = 0;
  for (let k = 0; k < order.length; k++) {
    cum += scores[order[k]];
    if (cum / total < threshold) below++;
  }
  const mask = new Uint8Array(scores.length);
  for (let k = 0; k < Math.min(below + 1, order.length); k++) mask[order[k]] = 1;
  return mask;
}

function normalizeRows(n, edges, a) {
  const row = new Float64Array(n);
  edges.forEach(function (e, k) { row[e.t] += Math.abs(a[k]); });
  return a.map(function (v, k) { return Math.abs(v) / Math.max(row[edges[k].t], 1e-10); });
}

// Keep the nodes holding `nodeTh` of the influence (embeddings and logits always), then the
// edges holding `edgeTh` of the influence flowing through the kept nodes; drop nodes left
// without an edge. Returns {nodes, edges: Uint8Array masks, influence}.
function prune(G, nodeTh, edgeTh) {
  const n = G.nodes.length, edges = G.edges, w = G.weights;
  const a = new Float64Array(edges.map(function (e) {
    return Math.abs(e.w) / Math.max(G.rowAbs[e.t], 1e-10);
  }));
  const infl = influenceOf(n, edges, a, w).map(function (v, i) { return v + w[i]; });
  const always = G.nodes.map(function (nd) { return nd.kind === "embedding" || nd.kind === "logit"; });
  const nodeMask = keepCumulative(infl, nodeTh);
  always.forEach(function (x, i) { if (x) nodeMask[i] = 1; });
  let kept = a.map(function (v, k) { return nodeMask[edges[k].t] && nodeMask[edges[k].s] ? v : 0; });
  kept = normalizeRows(n, edges, kept);
  const kInfl = influenceOf(n, edges, kept, w).map(function (v, i) { return v + w[i]; });
  const score = kept.map(function (v, k) { return v * kInfl[edges[k].t]; });
  const edgeMask = keepCumulative(score, edgeTh);
  kept.forEach(function (v, k) { if (!(v > 0)) edgeMask[k] = 0; });
  for (;;) {
    const has = new Uint8Array(n);
    edges.forEach(function (e, k) { if (edgeMask[k]) { has[e.t] = 1; has[e.s] = 1; } });
    let changed = false;
    for (let i = 0; i < n; i++) {
      if (nodeMask[i] && !has[i] && !always[i]) { nodeMask[i] = 0; changed = true; }
    }
    if (!changed) break;
    edges.forEach(function (e, k) { if (!nodeMask[e.t] || !nodeMask[e.s]) edgeMask[k] = 0; });
  }
  return { nodes: nodeMask, edges: edgeMask, influence: infl };
}

// ---- what is drawn: kept nodes, supernodes collapsed, edges summed --------------------------
// supers: [{name, members: [node index], collapsed}]. A collapsed supernode is one node; an
// edge between it and another node is the sum of its members' kept edges with that node;
// edges between two of its members are not drawn (their count and sum are reported).
function drawSet(G, pruned, supers) {
  const owner = new Map();  // node index -> supernode index (collapsed ones only)
  const pinned = new Set();
  supers.forEach(function (s, k) {
    s.members.forEach(function (m) { pinned.add(m); if (s.collapsed) owner.set(m, k); });
  });
  const items = [], keyOf = new Map();
  G.nodes.forEach(function (nd) {
    if (!(pruned.nodes[nd.i] || pinned.has(nd.i)) || owner.has(nd.i)) return;
    const item = { key: nd.id, kind: nd.kind, layer: nd.layer, pos: nd.pos, node: nd,
                   infl: pruned.influence[nd.i], members: null };
    keyOf.set(nd.i, item);
    items.push(item);
  });
  supers.forEach(function (s, k) {
    if (!s.collapsed) return;
    let layer = 0, pos = 0, infl = 0;
    s.members.forEach(function (m) { layer += G.nodes[m].layer; pos += G.nodes[m].pos; infl += pruned.influence[m]; });
    const item = { key: "supernode:" + s.name, kind: "super", name: s.name, members: s.members,
                   layer: Math.round(layer / s.members.length), pos: Math.round(pos / s.members.length),
                   infl: infl, internal: { count: 0, sum: 0 }, node: null };
    s.members.forEach(function (m) { keyOf.set(m, item); });
    items.push(item);
  });
  const sums = new Map();
  G.edges.forEach(function (e, k) {
    if (!pruned.edges[k]) return;
    const t = keyOf.get(e.t), s = keyOf.get(e.s);
    if (!t || !s) return;
    if (t === s) { t.internal.count++; t.internal.sum += e.w; return; }
    const id = t.key + "\u0000" + s.key;
    const got = sums.get(id);
    if (got) { got.w += e.w; got.n++; } else sums.set(id, { t: t, s: s, w: e.w, n: 1 });
  });
  const edges = Array.from(sums.values()).filter(function (e) { return e.w !== 0; });
  edges.sort(function (x, y) { return Math.abs(y.w) - Math.abs(x.w); });
  return { items: items, edges: edges };
}

// ---- layout: columns by position (as wide as their fullest cell), rows by layer -------------
function layout(G, items) {
  const rows = G.nLayers + 2;
  const cells = new Map();
  items.forEach(function (it) {
    const row = it.layer + 1;  // embeddings 0, layer l at l + 1, logits at n_layers + 1
    const key = it.pos * rows + row;
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(it);
  });
  const most = new Array(G.L).fill(1);
  cells.forEach(function (list, key) {
    const pos = Math.floor(key / rows);
    most[pos] = Math.max(most[pos], list.length);
  });
  const x0 = [], width = most.map(function (m) { return Math.max(MIN_COL, m * SPACING + 20); });
  let x = LEFT;
  width.forEach(function (w, p) { x0[p] = x; x += w; });
  cells.forEach(function (list, key) {
    const pos = Math.floor(key / rows), row = key % rows;
    list.sort(function (p, q) { return q.infl - p.infl; });
    list.forEach(function (it, k) {
      it.x = x0[pos] + width[pos] / 2 + (k - (list.length - 1) / 2) * SPACING;
      it.y = TOP + (rows - 1 - row) * ROW_H;
    });
  });
  return { width: x + 16, height: TOP + (rows - 1) * ROW_H + BOTTOM, x0: x0, colWidth: width, rows: rows };
}

function shapeOf(it, g) {
  const x = it.x, y = it.y;
  if (it.kind === "feature") return sel("circle", { cx: x, cy: y, r: 5.5 }, g);
  if (it.kind === "error") return sel("rect", { x: x - 5, y: y - 5, width: 10, height: 10 }, g);
  if (it.kind === "embedding") return sel("path", { d: "M" + x + " " + (y - 7) + "L" + (x + 7) + " " + (y + 5) + "L" + (x - 7) + " " + (y + 5) + "Z" }, g);
  if (it.kind === "logit") return sel("path", { d: "M" + x + " " + (y - 8) + "L" + (x + 7) + " " + y + "L" + x + " " + (y + 8) + "L" + (x - 7) + " " + y + "Z" }, g);
  return sel("rect", { x: x - 9, y: y - 9, width: 18, height: 18, rx: 5 }, g);
}

// Draw `set` into `svg`: axes, the strongest `maxEdges` edges, the nodes. Returns the
// elements by key, for highlighting.
function draw(svg, G, set, maxEdges) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const box = layout(G, set.items);
  svg.setAttribute("width", box.width);
  svg.setAttribute("height", box.height);
  svg.setAttribute("viewBox", "0 0 " + box.width + " " + box.height);
  const axes = sel("g", { class: "gv-axes" }, svg);
  for (let r = 0; r < box.rows; r++) {
    const y = TOP + (box.rows - 1 - r) * ROW_H;
    sel("line", { x1: LEFT - 6, x2: box.width - 8, y1: y, y2: y, class: "gv-grid" }, axes);
    const name = r === 0 ? "emb" : r === box.rows - 1 ? "logit" : "L" + (r - 1);
    sel("text", { x: 6, y: y + 4, class: "gv-axis" }, axes).textContent = name;
  }
  for (let p = 0; p < G.L; p++) {
    const tok = G.tokens[p] === undefined ? String(p) : G.tokens[p];
    const short = tok.length > 10 ? tok.slice(0, 9) + "\u2026" : tok;
    const cx = box.x0[p] + box.colWidth[p] / 2, cy = box.height - BOTTOM + 22;
    const t = sel("text", { x: cx, y: cy, class: "gv-token", "text-anchor": "end",
                            transform: "rotate(-35 " + cx + " " + cy + ")" }, axes);
    t.textContent = short.replace(/\n/g, "\\n").replace(/\t/g, "\\t");
    sel("title", {}, t).textContent = p + ": " + tok;
  }
  const shown = set.edges.slice(0, maxEdges);
  const top = shown.length ? Math.abs(shown[0].w) : 1;
  const eg = sel("g", { class: "gv-edges" }, svg);
  const edgeEls = [];
  shown.slice().reverse().forEach(function (e) {
    const s = e.s, t = e.t, strength = Math.abs(e.w) / top, my = (s.y + t.y) / 2;
    const path = sel("path", {
      d: "M" + s.x + " " + s.y + "C" + s.x + " " + my + " " + t.x + " " + my + " " + t.x + " " + t.y,
      stroke: e.w > 0 ? POS_COLOUR : NEG_COLOUR, "stroke-width": (0.4 + 3 * strength).toFixed(2),
      "stroke-opacity": (0.15 + 0.7 * strength).toFixed(3), fill: "none", class: "gv-edge" }, eg);
    path.dataset.source = s.key;
    path.dataset.target = t.key;
    path.dataset.weight = String(e.w);
    path.dataset.count = String(e.n);
    e.el = path;
    edgeEls.push(path);
  });
  const ng = sel("g", { class: "gv-nodes" }, svg);
  const nodeEls = new Map();
  set.items.forEach(function (it) {
    const g = sel("g", { class: "gv-node gv-" + it.kind, tabindex: "0", role: "button" }, ng);
    g.dataset.key = it.key;
    shapeOf(it, g);
    if (it.kind === "super" || it.kind === "logit") {  // logits: slanted, so neighbours fit
      const label = it.kind === "super" ? it.name : it.node.label;
      const lx = it.x + 2, ly = it.y - (it.kind === "super" ? 13 : 11);
      sel("text", { x: lx, y: ly, class: "gv-label",
                    transform: it.kind === "logit" ? "rotate(-40 " + lx + " " + ly + ")" : "" }, g)
        .textContent = label.length > 16 ? label.slice(0, 15) + "\u2026" : label;
    }
    nodeEls.set(it.key, g);
    it.el = g;
  });
  return { nodes: nodeEls, edges: edgeEls, shown: shown, box: box };
}
