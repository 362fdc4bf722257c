/* handformer serve: generation with a causal language model (the tokens streamed, each
   coloured by its attention) and chat mode (models with a chat template).
   Part of the page's controls (see serve.js): it uses the state and helpers of serve.js. */

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
