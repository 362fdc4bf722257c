/* handformer serve: the page's controls. Sends the text to the JSON API of the server that
   served this page and hands the answers to the attention viewer (window.hfViewer.render).
   User text and model output are only ever set with textContent, never as HTML. */
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const V = window.hfViewer;
  // Okabe & Ito's colour-blind-safe hues for the detector bars.
  const DETECTORS = [["previous_token", "previous token", "#0072B2"],
                     ["induction", "induction", "#E69F00"],
                     ["first_token", "first token", "#009E73"]];
  const STRONG = 0.4;  // a detector score that outlines the head in the grid
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
      box.appendChild(el("span", "sv-cand", c.token + " " + (100 * c.prob).toFixed(1) + "%"));
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
      box.appendChild(el("span", null, "Bars: detector scores on a probe of " + scores.probe.description +
        "; a head scoring " + STRONG + " or more is outlined in that colour:"));
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
          const v = scores[d[0]][l][h], i = el("i");
          i.style.height = Math.max(1, Math.round(12 * Math.min(1, v))) + "px";
          i.style.background = d[2];
          bars.appendChild(i);
          lines.push(d[1] + ": " + v.toFixed(2));
          if (v >= STRONG && (!best || v > best[0])) best = [v, d];
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

  // ---- generation (causal language models) ----------------------------------------------
  function paintGenerated(spans, attention) {
    const l = Math.min(V.state.layer, attention.length - 1), h = V.state.head;
    const rows = attention[l];
    const row = rows[0].map(function (_, j) {
      if (h >= 0 && h < rows.length) return rows[h][j];
      let s = 0;
      rows.forEach(function (r) { s += r[j]; });
      return s / rows.length;
    });
    const hi = Math.max.apply(null, row.concat([1e-9]));
    spans.forEach(function (s, j) {
      const a = j < row.length ? row[j] / hi : 0;
      s.style.background = a > 0.02 ? "rgba(230, 159, 0, " + a.toFixed(3) + ")" : "";
      s.classList.remove("query");
    });
  }

  function genBody() {
    const body = settings();
    body.max_new_tokens = +$("sv-max-new").value;
    const num = function (id) { const v = $(id).value.trim(); return v === "" ? null : Number(v); };
    const t = num("sv-temperature"), k = num("sv-top-k"), p = num("sv-top-p");
    if (t !== null) body.temperature = t;
    if (k !== null) body.top_k = k;
    if (p !== null) body.top_p = p;
    body.seed = num("sv-seed") || 0;
    if (mode === "chat") {
      delete body.text;
      body.messages = chat.concat([{ role: "user", content: $("sv-text").value }]);
    }
    return body;
  }

  function setGenerating(on) {
    $("sv-generate").disabled = on;
    $("sv-stop").disabled = !on;
    document.body.dataset.svGenerating = on ? "1" : "";
  }

  async function generate() {
    if (generation) return;
    const mine = ++seq;
    const body = genBody();
    const controller = new AbortController();
    generation = { controller: controller };
    setGenerating(true);
    const out = $("sv-gen-out");
    out.textContent = "";
    out.hidden = mode === "chat";
    let reply = null;
    if (mode === "chat") {
      chat.push({ role: "user", content: $("sv-text").value });
      showChat();
      reply = addMessage("assistant", "");
      $("sv-text").value = "";
    }
    status("generating\u2026");
    const spans = [], start = { n: 0 }, ids = [];
    let generated = "", ended = null;
    try {
      const res = await fetch("/api/generate", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (!res.ok) throw await failure(res);
      const reader = res.body.getReader(), decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true });
        let nl;
        while ((nl = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, nl);
          buffer = buffer.slice(nl + 1);
          if (!line.trim()) continue;
          const ev = JSON.parse(line);
          if (ev.event === "start") {
            notices(ev.notices);
            ev.prompt_ids.forEach(function (i) { ids.push(i); });
            if (ev.chat) $("sv-template").textContent = ev.prompt;
            start.n = ev.prompt_tokens.length;
            ev.prompt_tokens.forEach(function (t) { spans.push(out.appendChild(el("span", "tok", t))); });
            status("generating \u00b7 " + ev.model);
          } else if (ev.event === "token") {
            paintGenerated(spans, ev.attention);
            Object.keys(ev.relabel || {}).forEach(function (i) { spans[start.n + +i].textContent = ev.relabel[i]; });
            const s = out.appendChild(el("span", "tok query", ev.token));
            s.title = "p = " + ev.prob.toFixed(3);
            spans.push(s);
            ids.push(ev.id);
            generated += ev.text;
            if (reply) reply.body.textContent = generated;
            document.body.dataset.svGenerated = String(ev.index + 1);
          } else if (ev.event === "error") {
            throw new Error(ev.error);
          } else if (ev.event === "end") {
            ended = ev;
          }
        }
      }
    } catch (err) {
      if (err.name !== "AbortError") {
        generation = null;
        setGenerating(false);
        if (mine === seq) status(err.message, true);
        return;
      }
    }
    generation = null;
    setGenerating(false);
    const stopped = !ended;
    if (mode === "chat") {
      chat.push({ role: "assistant", content: generated });
      reply.body.textContent = generated;
    }
    document.body.dataset.svStopped = stopped ? "1" : "";
    const what = stopped ? "stopped after " + (spans.length - start.n) + " tokens"
                         : "generated " + ended.generated + " tokens (" + ended.reason + ")";
    if (mine === seq && ids.length) {
      // The viewer shows the prompt and the answer, token for token as generated; the
      // prompt box keeps the prompt.
      await run({ ids: ids });
    }
    status(what);
  }

  function stop() {
    if (generation) generation.controller.abort();
  }

  // ---- chat mode (models with a chat template) -------------------------------------------
  function addMessage(role, text) {
    const box = el("div", "sv-msg " + role);
    box.appendChild(el("span", "who", role));
    const body = el("span", "body", text);
    box.appendChild(body);
    $("sv-chat").appendChild(box);
    box.body = body;
    $("sv-chat").scrollTop = $("sv-chat").scrollHeight;
    return box;
  }
  function showChat() {
    $("sv-chat").textContent = "";
    chat.forEach(function (m) { addMessage(m.role, m.content); });
  }
  function setMode(m) {
    mode = m;
    ["text", "chat"].forEach(function (name) {
      $("sv-mode-" + name).setAttribute("aria-selected", String(name === m));
    });
    $("sv-chat-box").hidden = m !== "chat";
    $("sv-text-label").textContent = m === "chat" ? "Your message" : (info.type === "causal-lm" ? "Prompt" : "Text");
    $("sv-generate").textContent = m === "chat" ? "Send" : "Generate";
    document.body.dataset.svMode = m;
  }

  // ---- models ----------------------------------------------------------------------------
  function kindChanged() {
    $("sv-window-box").hidden = $("sv-kind").value !== "local";
    $("sv-stride-box").hidden = $("sv-kind").value !== "strided";
  }

  function applyInfo(next, keepText) {
    info = next;
    model = info.model;
    ablatedHeads = new Set();
    scores = null;
    chat = [];
    showChat();
    if (!keepText || !$("sv-text").value.trim()) $("sv-text").value = info.example;
    $("sv-pair-box").hidden = info.type !== "encoder";
    $("sv-gen-box").hidden = info.type !== "causal-lm";
    $("sv-mode-box").hidden = !info.chat_template;
    $("sv-attr-box").hidden = !hasAttribution();
    $("sv-attr").textContent = "";
    setMode("text");
    $("sv-model-note").textContent = info.layers + " layers \u00d7 " + info.heads + " heads" +
      (info.kv_heads && info.kv_heads < info.heads ? " (" + info.kv_heads + " key/value heads)" : "") +
      " \u00b7 " + (info.type === "causal-lm" ? "causal language model" : "encoder");
    const d = info.default_attention;
    $("sv-kind").value = d.kind;
    if (d.window_size) $("sv-window").value = d.window_size;
    if (d.stride) $("sv-stride").value = d.stride;
    kindChanged();
    buildGrid();
    document.body.dataset.svModel = model;
    const h1 = document.querySelector("header h1");
    if (h1) h1.textContent = "handformer serve: " + model;
    document.title = "handformer serve: " + model;
  }

  async function switchModel(name) {
    const previous = model;
    stop();
    status("loading " + name + "\u2026");
    try {
      const next = await getJSON("/api/model?model=" + encodeURIComponent(name));
      applyInfo(next, true);
      await run({ first: true });
    } catch (err) {
      await fillModels();  // the failed model is marked in the picker
      $("sv-model").value = previous;
      status(err.message, true);
    }
  }

  async function fillModels() {
    try {
      const r = await getJSON("/api/models");
      const sel = $("sv-model");
      sel.textContent = "";
      r.models.forEach(function (m) {
        const o = el("option", null, m.name + (m.error ? " (failed to load)" : ""));
        o.value = m.name;
        sel.appendChild(o);
      });
      sel.value = model;
      $("sv-model-box").hidden = r.models.length < 2;
    } catch (err) {
      $("sv-model-box").hidden = true;
    }
  }

  async function start() {
    try {
      applyInfo(await getJSON("/api/model"), false);
    } catch (err) {
      status("cannot reach the server: " + err.message, true);
      return;
    }
    $("sv-kind").addEventListener("change", function () { kindChanged(); run(); });
    $("sv-rollout").addEventListener("change", function () { run(); });
    $("sv-form").addEventListener("submit", function (e) { e.preventDefault(); run(); });
    $("sv-generate").addEventListener("click", generate);
    $("sv-stop").addEventListener("click", stop);
    $("sv-text").addEventListener("input", function () { $("sv-effect").textContent = ""; });
    $("sv-pair").addEventListener("input", function () { $("sv-effect").textContent = ""; });
    $("sv-text").addEventListener("keydown", function (e) {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
        e.preventDefault();
        if (mode === "chat") generate(); else run();
      }
    });
    $("sv-model").addEventListener("change", function (e) { switchModel(e.target.value); });
    $("sv-mode-text").addEventListener("click", function () { setMode("text"); });
    $("sv-mode-chat").addEventListener("click", function () { setMode("chat"); });
    $("sv-chat-clear").addEventListener("click", function () { chat = []; showChat(); });
    $("sv-attr-box").addEventListener("toggle", function () {
      if ($("sv-attr-box").open) attribution(seq, lastIds);
    });
    $("sv-grid").addEventListener("click", function (e) {
      const b = e.target.closest("button");
      if (!b) return;
      const key = b.dataset.l + "," + b.dataset.h;
      if (ablatedHeads.has(key)) ablatedHeads.delete(key); else ablatedHeads.add(key);
      paintGrid();
      run({ toggled: true });
    });
    document.querySelectorAll(".tab[data-view]").forEach(function (b) {
      b.addEventListener("click", function () { setTimeout(refreshStatus, 0); });
    });
    document.body.dataset.svReady = "1";
    fillModels();
    await run();
    loadScores();
  }

  start();
})();
