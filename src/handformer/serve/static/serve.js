/* handformer serve: the page's controls. Sends the text to the JSON API of the server that
   served this page and hands the answers to the attention viewer (window.hfViewer.render).
   User text and model output are only ever set with textContent, never as HTML.

   The script is six files of serve/static/, joined in this order inside one function by
   serve/page.py and served as /static/serve.js (so they share their top-level names):
     serve.js            the state, requests to the API, running the model and ablating
     serve_heads.js      the logit attribution and the head grid (ablation, detector scores)
     serve_generate.js   generation (streamed) and chat mode
     serve_features.js   the Features view (handformer serve --dictionary)
     serve_graph.js      the attribution graph (--graph, --transcoders), drawn by /static/graph.js
     serve_models.js     the model picker, the event handlers and the start-up */

const $ = (id) => document.getElementById(id);
const V = window.hfViewer;
let ablatedHeads = new Set();  // "layer,head"
let info = null, model = null, lastRun = null, lastIds = null, seq = 0, scores = null;
let generation = null;  // {controller} while a generation streams
let mode = "text", chat = [];  // chat mode: the conversation so far

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function count(key) {
  document.body.dataset[key] = String(+(document.body.dataset[key] || 0) + 1);
}

// ---- status line: what is shown (tokens, view, model, attention, ablated heads) ---------
let statusNote = "";
function status(text, isError) {
  statusNote = text || "";
  const s = $("sv-status");
  s.textContent = isError ? text : describe();
  s.classList.toggle("sv-error", !!isError);
  document.body.dataset.svError = isError ? text : "";
}
function describe() {
  const parts = [];
  if (statusNote) parts.push(statusNote);
  if (lastRun) {
    parts.push(lastRun.tokens.length + " tokens");
    const views = { heat: "heat map", head: "head view", model: "model view" };
    parts.push(($("sv-rollout").checked ? "attention rollout, " : "") + (views[V.state.view] || V.state.view));
    parts.push(lastRun.model + " \u00b7 " + lastRun.attention.description);
    const n = lastRun.heads_ablated.length;
    if (n) parts.push(n + " head" + (n > 1 ? "s" : "") + " ablated");
  }
  return parts.join(" \u00b7 ");
}
function refreshStatus() {
  if (!$("sv-status").classList.contains("sv-error")) $("sv-status").textContent = describe();
}

function notices(list) {
  const box = $("sv-notices");
  box.textContent = "";
  (list || []).forEach(function (n) { box.appendChild(el("p", null, n)); });
  box.hidden = !(list && list.length);
}

// An answer of ?weights=binary: "HFW1", the JSON header's length (uint32, little-endian),
// the JSON header, then the viewer's 8-bit weights, which the viewer takes as a Uint8Array.
function unpack(buf) {
  const magic = new Uint8Array(buf, 0, Math.min(4, buf.byteLength));
  if (String.fromCharCode.apply(null, magic) !== "HFW1") throw new Error("unexpected answer format");
  const n = new DataView(buf).getUint32(4, true);
  const r = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 8, n)));
  r.viewer.data = new Uint8Array(buf, 8 + n, r.viewer.data_bytes);
  return r;
}

async function failure(res) {
  const data = await res.json().catch(function () { return { error: res.statusText }; });
  return new Error(data.error || ("HTTP " + res.status));
}

// POST a JSON body; binary: ask for the viewer's weights as bytes (/api/run, /api/rollout).
async function post(path, body, binary) {
  const res = await fetch(binary ? path + "?weights=binary" : path, {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  if (!res.ok) throw await failure(res);
  if (binary) return unpack(await res.arrayBuffer());
  return res.json();
}

async function getJSON(path) {
  const res = await fetch(path);
  if (!res.ok) throw await failure(res);
  return res.json();
}

function heads() {
  return Array.from(ablatedHeads).map(function (k) { return k.split(",").map(Number); });
}

// The request body; ids: a causal model's input as token ids (what a generation made).
function settings(ids) {
  const body = { model: model, attention: $("sv-kind").value, heads: heads() };
  if (ids) body.ids = ids; else body.text = $("sv-text").value;
  if (info.type === "encoder" && $("sv-pair").value.trim()) body.text_pair = $("sv-pair").value;
  if (body.attention === "local") body.window_size = +$("sv-window").value;
  if (body.attention === "strided") body.stride = +$("sv-stride").value;
  return body;
}

function fmt(v) { return v === null || v === undefined ? "\u2013" : v.toFixed(4); }

function showCandidates(box, label, list) {
  box.appendChild(el("span", null, label + " "));
  list.forEach(function (c) {
    const s = box.appendChild(el("span", "sv-cand", c.token + " " + (100 * c.prob).toFixed(1) + "%"));
    s.title = "token id " + c.id + (/ of a character \(/.test(c.token) ?
      ": the first bytes of a character (their UTF-8 values in parentheses), which the tokens after it finish" : "");
  });
}

function showAnswer(r) {
  const box = $("sv-answer");
  box.textContent = "";
  if (r.next_token) showCandidates(box, r.heads_ablated.length ? "next token (ablated):" : "next token:", r.next_token);
  else if (r.similarity !== null && r.similarity !== undefined) {
    box.appendChild(el("span", null, "similarity of the two embeddings: "));
    box.appendChild(el("b", null, fmt(r.similarity) + (r.heads_ablated.length ? " (ablated)" : ""))).id = "sv-similarity";
  } else box.textContent = "type a second text to compare the two embeddings";
}

function showEffect(r) {
  const box = $("sv-effect");
  box.textContent = "";
  document.body.dataset.svAblated = String(r.heads_ablated.length);
  if (!r.heads_ablated.length) return;
  const n = r.heads_ablated.length + " head" + (r.heads_ablated.length > 1 ? "s" : "") + " ablated: ";
  if (r.metric === "next_token") {
    showCandidates(box, n + "clean next token", r.clean);
    box.appendChild(el("span", null, " (KL " + r.kl_divergence.toExponential(2) + ")"));
    return;
  }
  const what = r.metric === "similarity" ? "similarity " : "cosine to the clean embedding ";
  box.textContent = n + what + fmt(r.clean) + " \u2192 " + fmt(r.ablated) +
    " (\u0394 " + (r.delta >= 0 ? "+" : "") + r.delta.toFixed(4) + ")";
}

// Run the model on the text (or on token ids: prompt + generated): the viewer shows the
// ablated model's attention. first: open on the head `handformer viz` would choose.
async function run(opts) {
  opts = opts || {};
  const mine = ++seq;
  status("running\u2026");
  try {
    const body = settings(opts.ids);
    if (opts.first) body.choose_head = true;
    if (V.state.sink) body.include_sink = true;  // the viewer's "first token" checkbox
    const r = await post("/api/run", body, true);
    if (mine !== seq) return;
    lastRun = r;
    lastIds = opts.ids || null;
    notices(r.notices);
    showAnswer(r);
    if ($("sv-rollout").checked) await showRollout(mine, opts.ids);
    else await V.render(r.viewer, opts.first === true);
    if (mine !== seq) return;
    paintGrid();
    status("");
    count("svRuns");
    if (!opts.ids && (ablatedHeads.size || opts.toggled)) await ablate(mine);
    else showEffect({ heads_ablated: [] });
    if (opts.first) loadScores();
    attribution(mine, opts.ids);
    featureRun(mine, opts.ids);
  } catch (err) {
    if (mine === seq) status(err.message, true);
  }
}

async function showRollout(mine, ids) {
  const r = await post("/api/rollout", settings(ids), true);
  if (mine !== seq) return;
  await V.render(r.viewer);
}

// The effect line: the answer with and without the ablated heads.
async function ablate(mine) {
  try {
    const r = await post("/api/ablate", settings());
    if (mine !== seq) return;
    showEffect(r);
    if (r.metric === "similarity" && $("sv-similarity")) {
      $("sv-similarity").textContent = fmt(r.ablated) + (r.heads_ablated.length ? " (ablated)" : "");
    }
    count("svAblations");
  } catch (err) {
    if (mine === seq) status(err.message, true);
  }
}
