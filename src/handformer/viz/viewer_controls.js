/* handformer attention viewer: the tooltip, tabs and redraw; showing new data; the event
   handlers; window.hfViewer.render() and the start-up from #hf-data. The last part of the
   viewer's script (see viewer.js): it uses what the other three define. */

// ---- tooltip, tabs, redraw -------------------------------------------------------------
function showTip(e, text) {
  const tip = $("tooltip");
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = e.clientX + 14 + "px";
  tip.style.top = e.clientY + 14 + "px";
}
function hideTip() { $("tooltip").hidden = true; }

function setView(v) {
  S.view = v;
  ["heat", "head", "model"].forEach(function (name) {
    $("view-" + name).hidden = name !== v;
    $("tab-" + name).setAttribute("aria-selected", String(name === v));
  });
  $("head-label").hidden = v !== "heat";
  redraw();
}

let pending = false;
function redraw() {
  if (pending) return;
  pending = true;
  window.requestAnimationFrame(function () {
    pending = false;
    draw();
  });
}

function draw() {
  paintTokens();
  if (S.view === "heat") drawHeat();
  else if (S.view === "head") drawHeadView();
  else drawModel();
  document.body.dataset.query = S.query === null ? "" : String(S.query);
  document.body.dataset.view = S.view;
}

function fillSelect(sel, items, value) {
  sel.textContent = "";
  items.forEach(function (it) {
    const o = document.createElement("option");
    o.value = it[0]; o.textContent = it[1];
    sel.appendChild(o);
  });
  sel.value = String(value);
}

// Show the data set by setData(); `first` = the page's first data (its own layer, head and
// view), else the reader's current layer, head and view are kept where they still exist.
function show(weights, first) {
  W = weights;
  if (W.length !== N * H * LQ * LK) {
    throw new Error("the weights hold " + W.length + " values, expected " + N * H * LQ * LK);
  }
  PAT = D.pattern ? unpackBits(D.pattern.bits, LQ * LK) : null;
  $("pattern-panel").hidden = !D.pattern;
  $("pattern-caption").textContent = D.pattern ? D.pattern.label : "";
  if (first) { S.layer = D.layer || 0; S.head = D.head || 0; S.sink = D.include_sink === true; }
  $("sink").checked = S.sink;
  if (S.layer >= N) S.layer = 0;
  if (S.head >= H) S.head = 0;
  S.query = null; S.hover = null; S.hoverKey = null; S.cursor = null;
  if (first) { Z.cell = 0; Z.x0 = 0; Z.y0 = 0; }
  S.heads.clear();
  for (let h = 0; h < H; h++) S.heads.add(h);
  const info = [LQ + " tokens", N + " layer" + (N > 1 ? "s" : "") + " \u00d7 " + H + " head" + (H > 1 ? "s" : "")];
  if (D.note) info.push(D.note);
  $("info").textContent = info.join(" \u00b7 ");
  fillSelect($("layer"), Array.from({ length: N }, function (_, l) { return [l, String(l)]; }), S.layer);
  fillSelect($("head"), [[-1, "mean of heads"]].concat(
    Array.from({ length: H }, function (_, h) { return [h, String(h)]; })), S.head);
  buildTokens();
  buildChips();
  drawColourbar();
  setView(first ? D.view || "heat" : S.view);
  draw();
  if (first) document.body.dataset.openMs = String(Math.round(performance.now()));
  document.body.dataset.renders = String(+(document.body.dataset.renders || 0) + 1);
  document.body.dataset.ready = "1";
}

// Event handlers, bound once; they read the current data through the variables above.
function bind() {
  const box = $("tokens");
  box.addEventListener("mouseover", function (e) {
    if (e.target.dataset.i !== undefined) { S.hover = +e.target.dataset.i; redraw(); }
  });
  box.addEventListener("mouseleave", function () { S.hover = null; redraw(); });
  box.addEventListener("click", function (e) {
    if (e.target.dataset.i !== undefined) pin(+e.target.dataset.i);
  });
  $("head-chips").addEventListener("click", function (e) {
    const b = e.target.closest("button");
    if (!b) return;
    if (b.dataset.set === "all") for (let h = 0; h < H; h++) S.heads.add(h);
    else if (b.dataset.set === "none") S.heads.clear();
    else { const h = +b.dataset.h; if (S.heads.has(h)) S.heads.delete(h); else S.heads.add(h); }
    redraw();
  });
  $("layer").addEventListener("change", function (e) { S.layer = +e.target.value; redraw(); });
  $("head").addEventListener("change", function (e) { S.head = +e.target.value; redraw(); });
  $("boost").addEventListener("change", function (e) {
    S.boost = e.target.checked; drawColourbar(); redraw();
  });
  $("sink").addEventListener("change", function (e) { S.sink = e.target.checked; redraw(); });
  document.querySelectorAll(".tab[data-view]").forEach(function (b) {
    b.addEventListener("click", function () { setView(b.dataset.view); });
  });
  ["heat", "pattern"].forEach(function (id) {
    const cv = $(id);
    let drag = null;
    cv.addEventListener("mousemove", function (e) {
      if (drag && (e.buttons & 1)) {  // drag to pan (zoomed)
        const di = Math.trunc((drag.y - e.clientY) / heat.cell);
        const dj = Math.trunc((drag.x - e.clientX) / heat.cell);
        if (di || dj) {
          drag.moved = true;
          if (panBy(di, dj)) { drag.x = e.clientX; drag.y = e.clientY; }
        }
        return;
      }
      heatMove(e);
    });
    cv.addEventListener("mousedown", function (e) {
      drag = Z.cell ? { x: e.clientX, y: e.clientY, moved: false } : null;
    });
    cv.addEventListener("mouseleave", function () { hideTip(); S.cursor = null; redraw(); });
    cv.addEventListener("click", function (e) {
      const moved = drag && drag.moved;
      drag = null;
      if (moved) return;
      const c = cellAt(e); if (c) pin(c.i);
    });
    cv.addEventListener("wheel", function (e) {
      const c = cellAt(e);
      if (e.ctrlKey || e.metaKey) {  // pinch or Ctrl + wheel: zoom around the pointer
        e.preventDefault();
        zoomBy(e.deltaY < 0 ? 1.25 : 0.8, c ? c.i : undefined, c ? c.j : undefined);
        return;
      }
      const step = Math.sign(e.deltaY || e.deltaX) * 3;
      const moved = e.shiftKey || Math.abs(e.deltaX) > Math.abs(e.deltaY)
        ? panBy(0, step) : panBy(step, 0);
      if (moved) e.preventDefault();  // else the page scrolls on
    }, { passive: false });
  });
  if ($("zoom-in")) {
    $("zoom-in").addEventListener("click", function () { zoomBy(Z.cell ? 1.5 : Math.max(1.5, 14 / heat.cell)); });
    $("zoom-out").addEventListener("click", function () { if (Z.cell) zoomBy(1 / 1.5); });
    $("zoom-fit").addEventListener("click", zoomFit);
  }
  $("lines").addEventListener("mousemove", function (e) {
    const t = headTarget(e);
    const hq = t && t.side === "q" ? t.i : null, hk = t && t.side === "k" ? t.i : null;
    if (hq !== S.hover || hk !== S.hoverKey) { S.hover = hq; S.hoverKey = hk; redraw(); }
    if (hk !== null && S.query !== null) showTip(e, headWeights(S.query, hk));
    else hideTip();
  });
  $("lines").addEventListener("mouseleave", function () {
    S.hover = null; S.hoverKey = null; hideTip(); redraw();
  });
  $("lines").addEventListener("click", function (e) {
    const t = headTarget(e);
    if (t && t.side === "q") pin(t.i);
  });
  function openThumb(e) {
    if (e.target.dataset.l === undefined) return;
    S.layer = +e.target.dataset.l; S.head = +e.target.dataset.h;
    $("layer").value = String(S.layer); $("head").value = String(S.head);
    setView("heat");
  }
  $("grid").addEventListener("click", openThumb);
  $("grid").addEventListener("keydown", function (e) {
    if (e.key === "Enter" || e.key === " ") { e.preventDefault(); openThumb(e); }
  });
  document.addEventListener("keydown", function (e) {
    if (["SELECT", "INPUT", "TEXTAREA", "BUTTON"].includes(e.target.tagName)) return;
    if (e.target.dataset && e.target.dataset.l !== undefined) return;  // a grid thumbnail
    if (e.key === "Escape") { S.query = null; redraw(); }
    else if (e.key === "ArrowRight" || e.key === "ArrowDown") {
      S.query = S.query === null ? 0 : Math.min(LQ - 1, S.query + 1); showRow(S.query); redraw();
      e.preventDefault();
    } else if (e.key === "ArrowLeft" || e.key === "ArrowUp") {
      S.query = S.query === null ? 0 : Math.max(0, S.query - 1); showRow(S.query); redraw();
      e.preventDefault();
    } else if (S.view === "heat" && (e.key === "+" || e.key === "=")) {
      zoomBy(Z.cell ? 1.5 : Math.max(1.5, 14 / heat.cell), S.query === null ? undefined : S.query);
    } else if (S.view === "heat" && e.key === "-") { if (Z.cell) zoomBy(1 / 1.5); }
    else if (S.view === "heat" && e.key === "0") zoomFit();
  });
  let resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(redraw, 150);
  });
}

function fail(err) {
  const box = $("error");
  box.hidden = false;
  box.textContent = "Could not show the attention: " + (err && err.message ? err.message : err);
  document.body.dataset.ready = "error";
  throw err;
}

// Draw new viewer data (the JSON of #hf-data) in place of the current one; resolves once
// it is shown. Pages that fetch their data (`handformer serve`) call it.
// Only the latest call is shown when several overlap.
let bound = false, latest = 0;
function render(data, first) {
  const call = ++latest;
  return decode(data).then(function (w) {
    if (call !== latest) return;
    setData(data);
    window.hfViewer.data = data;
    if (!bound) { bind(); bound = true; }
    show(w, first === true);
  });
}

window.hfViewer = { state: S, redraw: redraw, data: null, render: render };
const embedded = document.getElementById("hf-data");
if (embedded && embedded.textContent.trim()) {
  render(JSON.parse(embedded.textContent), true).catch(fail);
}
