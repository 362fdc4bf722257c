/* handformer serve: the direct logit attribution of the answer token, and the head grid
   (click a head to ablate it; detector scores as bars; key/value groups).
   Part of the page's controls (see serve.js): it uses the state and helpers of serve.js. */

// Okabe & Ito's colour-blind-safe hues for the detector bars.
const DETECTORS = [["previous_token", "previous token", "#0072B2"],
                   ["induction", "induction", "#E69F00"],
                   ["first_token", "first token", "#009E73"]];
const STRONG = 0.4;  // outline a head scoring this share of a perfect head's score or more

// What a perfect head would score on the probe (induction: about 0.5, the first copy has
// nothing to find); older answers without it: 1.
function perfect(d) {
  const p = scores && scores.probe && scores.probe.perfect;
  return p && p[d[0]] > 0 ? p[d[0]] : 1;
}

// ---- direct logit attribution of the answer token (causal models) ----------------------
function hasAttribution() {
  return info.type === "causal-lm" && (info.endpoints || []).indexOf("/api/attribution") >= 0;
}

async function attribution(mine, ids) {
  const box = $("sv-attr-box");
  box.hidden = !hasAttribution();
  if (box.hidden || !box.open) return;
  try {
    const body = settings(ids);
    delete body.choose_head;
    const r = await post("/api/attribution", body);
    if (mine !== seq) return;
    showAttribution(r);
  } catch (err) {
    $("sv-attr").textContent = "attribution: " + err.message;
  }
}

function barRow(table, label, v, scale) {
  const tr = el("tr");
  tr.appendChild(el("td", null, label));
  tr.appendChild(el("td", null, (v >= 0 ? "+" : "") + v.toFixed(3)));
  const cell = el("td", "barcell"), bar = el("span", "bar");
  bar.style.width = Math.round(150 * Math.abs(v) / scale) + "px";
  bar.style.background = v >= 0 ? "#0072B2" : "#D55E00";
  cell.appendChild(bar);
  tr.appendChild(cell);
  table.appendChild(tr);
}

function showAttribution(r) {
  const box = $("sv-attr");
  box.textContent = "";
  box.appendChild(el("p", null, "Answer token " + r.token.token + ": logit " + r.logit.toFixed(3) +
    " = the sum of what each part of the residual stream adds (blue raises it, vermilion lowers it)" +
    (r.heads_ablated.length ? "; with " + r.heads_ablated.length + " head(s) ablated" : "") + "."));
  const comps = r.components.labels.map(function (l, i) { return [l, r.components.values[i]]; });
  comps.sort(function (a, b) { return Math.abs(b[1]) - Math.abs(a[1]); });
  const heads = [];
  r.heads.grid.forEach(function (row, l) {
    row.forEach(function (v, h) { heads.push(["layer " + l + ", head " + h, v, l, h]); });
  });
  heads.sort(function (a, b) { return Math.abs(b[1]) - Math.abs(a[1]); });
  [["Largest parts", comps.slice(0, 8)], ["Largest heads", heads.slice(0, 10)]].forEach(function (part) {
    const table = el("table"), head = el("tr");
    [part[0], "logit", ""].forEach(function (t) { head.appendChild(el("th", null, t)); });
    table.appendChild(head);
    const scale = Math.max(1e-9, Math.abs(part[1].length ? part[1][0][1] : 1));
    part[1].forEach(function (row) { barRow(table, row[0], row[1], scale); });
    box.appendChild(table);
  });
  document.body.dataset.svAttribution = String(+(document.body.dataset.svAttribution || 0) + 1);
}

// ---- the head grid: ablation, detector scores, key-value groups ------------------------
function kvGroup(h) {
  const kv = info.kv_heads || info.heads;
  return Math.floor(h / (info.heads / kv));
}

function buildGrid() {
  const grid = $("sv-grid");
  grid.textContent = "";
  grid.style.gridTemplateColumns = "auto repeat(" + info.heads + ", auto)";
  grid.appendChild(el("span", "lab", ""));
  const gqa = info.kv_heads && info.kv_heads < info.heads;
  for (let h = 0; h < info.heads; h++) {
    const lab = el("span", "lab", "h" + h);
    if (gqa) lab.title = "query head " + h + " reads key/value head " + kvGroup(h);
    grid.appendChild(lab);
  }
  for (let l = 0; l < info.layers; l++) {
    grid.appendChild(el("span", "lab", "layer " + l));
    for (let h = 0; h < info.heads; h++) {
      const b = el("button");
      b.type = "button";
      b.dataset.l = l; b.dataset.h = h;
      if (gqa && kvGroup(h) % 2 === 1) b.classList.add("kv-odd");
      b.appendChild(el("span", "num", String(h)));
      b.appendChild(el("span", "bars"));
      grid.appendChild(b);
    }
  }
  legend();
  paintGrid();
}

function legend() {
  const box = $("sv-legend");
  box.textContent = "";
  const gqa = info.kv_heads && info.kv_heads < info.heads;
  if (gqa) {
    box.appendChild(el("span", null, "Grouped-query attention: " + info.heads + " query heads share " +
      info.kv_heads + " key/value heads (" + info.heads / info.kv_heads + " each; shaded groups)."));
  }
  if (scores) {
    box.appendChild(el("span", null, "Bars: detector scores (detect_heads') on a probe of " +
      scores.probe.description + ", as a share of a perfect head's; a head at " + STRONG +
      " of it or more is outlined in that colour:"));
    DETECTORS.forEach(function (d) {
      const s = el("span");
      const sw = el("span", "sw");
      sw.style.background = d[2];
      s.appendChild(sw);
      s.appendChild(document.createTextNode(d[1]));
      box.appendChild(s);
    });
  } else if (info.type) {
    box.appendChild(el("span", null, "computing detector scores\u2026"));
  }
}

function paintGrid() {
  Array.from($("sv-grid").querySelectorAll("button")).forEach(function (b) {
    const l = +b.dataset.l, h = +b.dataset.h, key = l + "," + h, off = ablatedHeads.has(key);
    b.classList.toggle("off", off);
    b.setAttribute("aria-pressed", String(off));
    const lines = ["layer " + l + ", head " + h + (off ? " (ablated: click to restore)" : ": click to ablate")];
    if (info.kv_heads && info.kv_heads < info.heads) lines.push("key/value head " + kvGroup(h));
    const bars = b.querySelector(".bars");
    bars.textContent = "";
    b.style.borderColor = "";
    b.classList.remove("strong");
    if (scores) {
      let best = null;
      DETECTORS.forEach(function (d) {
        const v = scores[d[0]][l][h], share = Math.min(1, v / perfect(d)), i = el("i");
        i.style.height = Math.max(1, Math.round(12 * share)) + "px";
        i.style.background = d[2];
        bars.appendChild(i);
        lines.push(d[1] + ": " + v.toFixed(2) + " (a perfect head: " + perfect(d).toFixed(2) + ")");
        if (share >= STRONG && (!best || share > best[0])) best = [share, d];
      });
      if (best && !off) {  // outlined in its detector's colour: a head worth a click
        b.classList.add("strong");
        b.style.borderColor = best[1][2];
        lines.push("a strong " + best[1][1] + " head");
      }
    }
    b.title = lines.join("\n");
    b.setAttribute("aria-label", lines.join(", "));
  });
}

async function loadScores() {
  const name = model;
  try {
    const r = await getJSON("/api/heads?model=" + encodeURIComponent(name));
    if (name !== model) return;
    scores = r;
    legend();
    paintGrid();
    document.body.dataset.svScores = "1";
  } catch (err) {
    $("sv-legend").textContent = "detector scores: " + err.message;
  }
}
