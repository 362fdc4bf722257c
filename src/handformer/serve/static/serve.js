/* handformer serve: the page's controls. Sends the text to the JSON API of the server that
   served this page and hands the answers to the attention viewer (window.hfViewer.render).
   User text and model output are only ever set with textContent, never as HTML. */
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const V = window.hfViewer;
  const ablatedHeads = new Set();  // "layer,head"
  let info = null, lastRun = null, seq = 0;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function status(text, isError) {
    const s = $("sv-status");
    s.textContent = text;
    s.classList.toggle("sv-error", !!isError);
    document.body.dataset.svError = isError ? text : "";
  }

  function notices(list) {
    const box = $("sv-notices");
    box.textContent = (list || []).join(" ");
    box.hidden = !(list && list.length);
  }

  function who(r) { return r.model + " \u00b7 " + r.attention.description; }

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

  // POST a JSON body; binary: ask for the viewer's weights as bytes (/api/run, /api/rollout).
  async function post(path, body, binary) {
    const res = await fetch(binary ? path + "?weights=binary" : path, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (res.ok && binary) return unpack(await res.arrayBuffer());
    const data = await res.json().catch(function () { return { error: res.statusText }; });
    if (!res.ok) throw new Error(data.error || ("HTTP " + res.status));
    return data;
  }

  function heads() {
    return Array.from(ablatedHeads).map(function (k) { return k.split(",").map(Number); });
  }

  function settings(withHeads) {
    const body = { text: $("sv-text").value, attention: $("sv-kind").value };
    if (info.type === "encoder" && $("sv-pair").value.trim()) body.text_pair = $("sv-pair").value;
    if (body.attention === "local") body.window_size = +$("sv-window").value;
    if (body.attention === "strided") body.stride = +$("sv-stride").value;
    if (withHeads) body.heads = heads();
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
    if (r.next_token) showCandidates(box, "next token:", r.next_token);
    else if (r.similarity !== null && r.similarity !== undefined) {
      box.appendChild(el("span", null, "similarity of the two embeddings: "));
      box.appendChild(el("b", null, fmt(r.similarity))).id = "sv-similarity";
    } else box.textContent = "type a second text to compare the two embeddings";
  }

  function showEffect(r) {
    const box = $("sv-effect");
    box.textContent = "";
    document.body.dataset.svAblated = String(r.heads_ablated.length);
    const sim = $("sv-similarity");
    if (!r.heads_ablated.length) {  // every head restored: the clean answer again
      if (sim && lastRun) sim.textContent = fmt(lastRun.similarity);
      return;
    }
    const n = r.heads_ablated.length + " head" + (r.heads_ablated.length > 1 ? "s" : "") + " ablated: ";
    if (r.metric === "next_token") {
      showCandidates(box, n + "next token", r.ablated);
      box.appendChild(el("span", null, " (KL " + r.kl_divergence.toExponential(2) + ")"));
      return;
    }
    const what = r.metric === "similarity" ? "similarity " : "cosine to the clean embedding ";
    box.textContent = n + what + fmt(r.clean) + " \u2192 " + fmt(r.ablated) +
      " (\u0394 " + (r.delta >= 0 ? "+" : "") + r.delta.toFixed(4) + ")";
    if (sim && r.metric === "similarity") sim.textContent = fmt(r.ablated) + " (ablated)";
  }

  async function run() {
    const mine = ++seq;
    status("running\u2026");
    try {
      const r = await post("/api/run", settings(false), true);
      if (mine !== seq) return;
      lastRun = r;
      notices(r.notices);
      showAnswer(r);
      if ($("sv-rollout").checked) await showRollout(mine);
      else await V.render(r.viewer);
      if (mine !== seq) return;
      const rolled = $("sv-rollout").checked ? "attention rollout \u00b7 " : "";
      status(r.tokens.length + " tokens \u00b7 " + rolled + who(r));
      document.body.dataset.svRuns = String(+(document.body.dataset.svRuns || 0) + 1);
      if (ablatedHeads.size) await ablate();
      else showEffect({ heads_ablated: [] });
    } catch (err) {
      if (mine === seq) status(err.message, true);
    }
  }

  async function showRollout(mine) {
    const r = await post("/api/rollout", settings(true), true);
    if (mine !== seq) return;
    await V.render(r.viewer);
  }

  async function ablate() {
    const mine = ++seq;
    try {
      const r = await post("/api/ablate", settings(true));
      if (mine !== seq) return;
      showEffect(r);
      status("ablation \u00b7 " + who(r));
      document.body.dataset.svAblations = String(+(document.body.dataset.svAblations || 0) + 1);
    } catch (err) {
      if (mine === seq) status(err.message, true);
    }
  }

  function buildGrid() {
    const grid = $("sv-grid");
    grid.textContent = "";
    grid.style.gridTemplateColumns = "auto repeat(" + info.heads + ", auto)";
    grid.appendChild(el("span", "lab", ""));
    for (let h = 0; h < info.heads; h++) grid.appendChild(el("span", "lab", "h" + h));
    for (let l = 0; l < info.layers; l++) {
      grid.appendChild(el("span", "lab", "layer " + l));
      for (let h = 0; h < info.heads; h++) {
        const b = el("button", null, String(h));
        b.type = "button";
        b.dataset.l = l; b.dataset.h = h;
        b.title = "layer " + l + ", head " + h + ": click to ablate";
        grid.appendChild(b);
      }
    }
    grid.addEventListener("click", function (e) {
      const b = e.target.closest("button");
      if (!b) return;
      const key = b.dataset.l + "," + b.dataset.h;
      if (ablatedHeads.has(key)) ablatedHeads.delete(key); else ablatedHeads.add(key);
      b.classList.toggle("off", ablatedHeads.has(key));
      if ($("sv-rollout").checked) run(); else ablate();
    });
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
      s.style.background = a > 0.02 ? "rgba(255, 140, 0, " + a.toFixed(3) + ")" : "";
      s.classList.remove("query");
    });
  }

  async function generate() {
    const mine = ++seq;
    const body = settings(true);
    body.max_new_tokens = +$("sv-max-new").value;
    const out = $("sv-gen-out");
    out.textContent = "";
    out.hidden = false;
    status("generating\u2026");
    const spans = [];
    let generated = "";
    try {
      const res = await fetch("/api/generate", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      if (!res.ok) {
        const data = await res.json().catch(function () { return {}; });
        throw new Error(data.error || ("HTTP " + res.status));
      }
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
            ev.prompt_tokens.forEach(function (t) { spans.push(out.appendChild(el("span", "tok", t))); });
            status("generating \u00b7 " + who(ev));
          } else if (ev.event === "token") {
            paintGenerated(spans, ev.attention);
            const s = out.appendChild(el("span", "tok query", ev.token));
            s.title = "p = " + ev.prob.toFixed(3);
            spans.push(s);
            generated += ev.text;
            document.body.dataset.svGenerated = String(ev.index + 1);
          } else if (ev.event === "error") {
            throw new Error(ev.error);
          } else if (ev.event === "end") {
            status("generated " + ev.generated + " tokens (" + ev.reason + ")");
          }
        }
      }
      if (mine === seq && generated) {
        $("sv-text").value += generated;
        await run();
      }
    } catch (err) {
      if (mine === seq) status(err.message, true);
    }
  }

  function kindChanged() {
    $("sv-window-box").hidden = $("sv-kind").value !== "local";
    $("sv-stride-box").hidden = $("sv-kind").value !== "strided";
  }

  async function start() {
    try {
      const res = await fetch("/api/model");
      info = await res.json();
    } catch (err) {
      status("cannot reach the server: " + err.message, true);
      return;
    }
    $("sv-text").value = info.example;
    $("sv-pair-box").hidden = info.type !== "encoder";
    $("sv-gen-box").hidden = info.type !== "causal-lm";
    const d = info.default_attention;
    $("sv-kind").value = d.kind;
    if (d.window_size) $("sv-window").value = d.window_size;
    if (d.stride) $("sv-stride").value = d.stride;
    kindChanged();
    buildGrid();
    $("sv-kind").addEventListener("change", function () { kindChanged(); run(); });
    $("sv-rollout").addEventListener("change", run);
    $("sv-form").addEventListener("submit", function (e) { e.preventDefault(); run(); });
    $("sv-generate").addEventListener("click", generate);
    document.body.dataset.svReady = "1";
    await run();
  }

  start();
})();
