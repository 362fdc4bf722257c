/* handformer serve: the Features view (with --dictionary). The text's tokens in a strip: the
   token under the cursor (or focused) lists its most active features; a click on one opens its
   card (top-activating contexts, the tokens it promotes and suppresses) with Ablate and Steer,
   which show the next token and a short greedy continuation with and without the change.
   Text from the model or the user is only ever set with textContent. */

let featInfo = null;    // GET /api/features
let featActive = null;  // the last /api/features/active answer
let featIds = null;     // the ids it ran on (a generation's), or null for the text box
let featPinned = -1;    // the token whose features are listed (clicked), -1: follow the cursor
let featSeq = 0;

function featOn() {
  return !!(featInfo && featInfo.dictionaries.length && model === featInfo.model);
}

async function loadFeatures() {
  try {
    featInfo = await getJSON("/api/features");
  } catch (err) {
    featInfo = null;
  }
  const sel = $("sv-feat-dict");
  sel.textContent = "";
  ((featInfo && featInfo.dictionaries) || []).forEach(function (d) {
    const o = el("option", null, d.name + " \u00b7 " + d.hook + " \u00b7 " + d.d_sae + " features");
    o.value = d.name;
    sel.appendChild(o);
  });
  sel.addEventListener("change", function () { featureRun(seq, featIds); });
  $("sv-feat-tokens").addEventListener("mouseover", function (e) {
    const t = e.target.closest("[data-pos]");
    if (t && featPinned < 0) featureList(+t.dataset.pos);
  });
  $("sv-feat-tokens").addEventListener("click", function (e) {
    const t = e.target.closest("[data-pos]");
    if (!t) return;
    featPinned = featPinned === +t.dataset.pos ? -1 : +t.dataset.pos;
    featureList(+t.dataset.pos);
  });
  $("sv-feat-list").addEventListener("click", function (e) {
    const b = e.target.closest("button[data-feature]");
    if (b) featureCard(+b.dataset.feature);
  });
}

function featBody(extra) {
  const body = { model: model, dictionary: $("sv-feat-dict").value };
  if (featIds) body.ids = featIds; else body.text = $("sv-text").value;
  return Object.assign(body, extra || {});
}

// After each run: the active features of every token (the list follows the cursor).
async function featureRun(mine, ids) {
  const box = $("sv-feat-box");
  box.hidden = !featOn();
  if (box.hidden) return;
  featIds = ids || null;
  const my = ++featSeq;
  try {
    const r = await post("/api/features/active", featBody({ top: 8 }));
    if (my !== featSeq || mine !== seq) return;
    featActive = r;
    featPinned = -1;
    const strip = $("sv-feat-tokens");
    strip.textContent = "";
    r.tokens.forEach(function (t, i) {
      const s = strip.appendChild(el("span", "tok", t));
      s.dataset.pos = String(i);
      s.tabIndex = 0;
      s.title = r.l0[i] + " active features";
      s.addEventListener("focus", function () { if (featPinned < 0) featureList(i); });
    });
    featureList(r.tokens.length - 1);
    count("svFeatureRuns");
  } catch (err) {
    $("sv-feat-list").textContent = "features: " + err.message;
  }
}

function featureList(pos) {
  if (!featActive) return;
  const list = $("sv-feat-list");
  list.textContent = "";
  document.querySelectorAll("#sv-feat-tokens [data-pos]").forEach(function (s) {
    s.style.outline = +s.dataset.pos === pos ? "2px solid #0072B2" : "";
  });
  const active = featActive.active[pos];
  list.appendChild(el("span", "muted", "token " + pos + " \u201c" + featActive.tokens[pos] + "\u201d: " +
    featActive.l0[pos] + " active" + (active.length ? "; the largest: " : "")));
  active.forEach(function (a) {
    const b = list.appendChild(el("button", "sv-cand", "#" + a.feature + " " + a.value.toFixed(2)));
    b.type = "button";
    b.dataset.feature = String(a.feature);
  });
  list.dataset.pos = String(pos);
}

function tokenRow(box, label, list) {
  const p = box.appendChild(el("p", null, label + " "));
  (list || []).forEach(function (t) {
    p.appendChild(el("span", "sv-cand", t.token + " " + (t.value >= 0 ? "+" : "") + t.value.toFixed(2)));
  });
}

async function featureCard(f) {
  const card = $("sv-feat-card");
  card.textContent = "loading feature " + f + "\u2026";
  try {
    const r = await post("/api/features/card", { model: model, dictionary: $("sv-feat-dict").value, feature: f });
    card.textContent = "";
    card.dataset.feature = String(f);
    card.appendChild(el("h4", null, "Feature " + f + " \u00b7 active on " + (100 * r.density).toFixed(2) +
      "% of " + r.tokens_seen + " tokens (the built-in sample and " + r.texts_seen + " texts seen)"));
    const ctx = card.appendChild(el("div", "sv-feat-contexts"));
    if (!r.contexts.length) ctx.appendChild(el("p", "muted", "not active in the texts seen yet"));
    r.contexts.forEach(function (c) {
      const p = ctx.appendChild(el("p", "tokens"));
      p.appendChild(el("span", "muted", c.activation.toFixed(2) + " "));
      p.appendChild(el("span", null, c.before));
      const m = p.appendChild(el("mark", null, c.token));
      m.style.fontWeight = "bold";
      p.appendChild(el("span", null, c.after));
    });
    if (r.promoted) {
      tokenRow(card, "promotes:", r.promoted);
      tokenRow(card, "suppresses:", r.suppressed);
    }
    const row = card.appendChild(el("p"));
    const ab = row.appendChild(el("button", null, "Ablate"));
    ab.type = "button";
    ab.id = "sv-feat-ablate";
    row.appendChild(el("span", null, " or steer with coefficient "));
    const k = row.appendChild(el("input"));
    k.type = "number"; k.id = "sv-feat-coef"; k.value = "8"; k.step = "any"; k.style.width = "5em";
    const st = row.appendChild(el("button", null, "Steer"));
    st.type = "button";
    st.id = "sv-feat-steer";
    card.appendChild(el("div", null)).id = "sv-feat-change";
    ab.addEventListener("click", function () { featureChange(f, "ablate"); });
    st.addEventListener("click", function () { featureChange(f, "steer"); });
    count("svFeatureCards");
  } catch (err) {
    card.textContent = "feature " + f + ": " + err.message;
  }
}

async function featureChange(f, mode) {
  const box = $("sv-feat-change");
  box.textContent = (mode === "ablate" ? "ablating" : "steering with") + " feature " + f + "\u2026";
  const extra = { feature: f, mode: mode, new_tokens: 12 };
  if (mode === "steer") extra.coefficient = +$("sv-feat-coef").value;
  try {
    const r = await post("/api/features/intervene", featBody(extra));
    box.textContent = "";
    const what = mode === "ablate" ? "ablated" : "steered (" + r.coefficient + " \u00d7 W_dec[" + f + "])";
    showCandidates(box.appendChild(el("p")), "next token, clean:", r.clean);
    showCandidates(box.appendChild(el("p")), what + ":", r.changed);
    box.appendChild(el("p", "muted", "KL(clean \u2016 " + mode + "ed) = " + r.kl_divergence.toExponential(2)));
    const c = box.appendChild(el("p", "tokens"));
    c.appendChild(el("span", "muted", "continues, clean: "));
    c.appendChild(el("span", null, r.clean_text));
    const d = box.appendChild(el("p", "tokens"));
    d.appendChild(el("span", "muted", what + ": "));
    d.appendChild(el("span", "sv-feat-changed", r.changed_text)).id = "sv-feat-changed";
    (r.notices || []).forEach(function (n) { box.appendChild(el("p", "muted", n)); });
    count("svFeatureChanges");
  } catch (err) {
    box.textContent = mode + ": " + err.message;
  }
}
