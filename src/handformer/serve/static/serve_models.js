/* handformer serve: the model picker, the event handlers and the start-up. The last part of
   the page's controls (see serve.js): it uses what the other three define. */

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
  loadGraphs();
  await loadFeatures();
  await run();
  loadScores();
}

start();
