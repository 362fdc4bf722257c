/* handformer attention viewer. Everything it shows comes from the JSON in #hf-data (or from
   window.hfViewer.render(data) with the same JSON, where data.data may also be the weights
   as a Uint8Array); it loads nothing from the network.
   Weights are 8-bit per value, each head scaled to [lo, hi]. */
"use strict";
(function () {
  // The data shown now; setData() replaces all of it (render() draws new data in place).
  let D = null, N = 0, H = 0, QT = [], KT = [], LQ = 0, LK = 0, LEVELS = 255;
  const $ = (id) => document.getElementById(id);
  const S = { view: "heat", layer: 0, head: 0, heads: new Set(),
              query: null, hover: null, hoverKey: null, boost: false };
  let W = null;    // Uint8Array (N * H * LQ * LK)
  let PAT = null;  // Uint8Array (LQ * LK) of 0/1, or null
  let LUT = null;  // 256 x RGB
  const meanCache = new Map();

  function setData(data) {
    D = data;
    N = D.layers; H = D.heads; QT = D.tokens; KT = D.key_tokens || D.tokens;
    LQ = QT.length; LK = KT.length; LEVELS = D.levels || 255;
    LUT = bytes(D.colormap);
    meanCache.clear();
    thumbs.clear();
  }

  function bytes(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  // d.data: base64 text (the JSON of #hf-data), or the codes themselves as a Uint8Array
  // (what `handformer serve` pages fetch with ?weights=binary).
  async function decode(d) {
    const raw = d.data instanceof Uint8Array ? d.data : bytes(d.data);
    if (d.encoding === "raw") return raw;
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot inflate the compressed weights " +
                      "(DecompressionStream is missing); open the file in a recent browser");
    }
    const stream = new Blob([raw]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }

  function unpackBits(b64, n) {
    const packed = bytes(b64), out = new Uint8Array(n);
    for (let i = 0; i < n; i++) out[i] = (packed[i >> 3] >> (7 - (i & 7))) & 1;
    return out;
  }

  // ---- weights ---------------------------------------------------------------------------
  // One head's matrix as floats, with its range; h < 0 means the mean over heads.
  function matrix(l, h) {
    if (h < 0) return meanMatrix(l);
    const s = D.scale[l * H + h], lo = s[0], k = (s[1] - s[0]) / LEVELS;
    const base = (l * H + h) * LQ * LK, m = new Float32Array(LQ * LK);
    for (let i = 0; i < LQ * LK; i++) m[i] = lo + W[base + i] * k;
    return { m: m, lo: Math.min(0, lo), hi: s[1] };
  }

  function meanMatrix(l) {
    if (meanCache.has(l)) return meanCache.get(l);
    const m = new Float32Array(LQ * LK);
    for (let h = 0; h < H; h++) {
      const one = matrix(l, h).m;
      for (let i = 0; i < m.length; i++) m[i] += one[i] / H;
    }
    let lo = 0, hi = 0;
    for (let i = 0; i < m.length; i++) { if (m[i] > hi) hi = m[i]; if (m[i] < lo) lo = m[i]; }
    const r = { m: m, lo: lo, hi: hi };
    meanCache.set(l, r);
    return r;
  }

  function weight(l, h, i, j) {
    const s = D.scale[l * H + h];
    return s[0] + W[((l * H + h) * LQ + i) * LK + j] * (s[1] - s[0]) / LEVELS;
  }

  function colourIndex(v, lo, hi) {
    let t = hi > lo ? (v - lo) / (hi - lo) : 0;
    t = Math.min(1, Math.max(0, t));
    if (S.boost) t = Math.sqrt(t);
    return Math.round(t * 255) * 3;
  }

  function active() { return S.hover !== null ? S.hover : S.query; }
  function fmt(v) { return v.toFixed(3); }
  function headColour(h, alpha) {
    return "hsla(" + Math.round((h * 360) / Math.max(H, 1) + 10) + ", 70%, 45%, " + alpha + ")";
  }

  // A canvas sized in CSS pixels, drawn sharply on high-DPI screens.
  function sizeCanvas(cv, w, h) {
    const dpr = window.devicePixelRatio || 1;
    cv.width = Math.max(1, Math.round(w * dpr));
    cv.height = Math.max(1, Math.round(h * dpr));
    cv.style.width = w + "px";
    cv.style.height = h + "px";
    const ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }

  // An L_q x L_k image of a matrix (one pixel per cell) on an offscreen canvas.
  function imageOf(r) {
    const off = document.createElement("canvas");
    off.width = LK; off.height = LQ;
    const ctx = off.getContext("2d"), img = ctx.createImageData(LK, LQ), px = img.data;
    const lo = r.lo, hi = r.hi;
    for (let i = 0; i < LQ * LK; i++) {
      const c = colourIndex(r.m[i], lo, hi);
      px[4 * i] = LUT[c]; px[4 * i + 1] = LUT[c + 1]; px[4 * i + 2] = LUT[c + 2]; px[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    return off;
  }

  // A matrix max-pooled to at most `size` cells a side (thin diagonals survive), coloured
  // from 0 to its maximum.
  function pooledImage(r, size) {
    const f = Math.max(1, Math.ceil(Math.max(LQ, LK) / size));
    const R = Math.ceil(LQ / f), C = Math.ceil(LK / f), m = new Float32Array(R * C);
    for (let i = 0; i < LQ; i++) {
      const row = ((i / f) | 0) * C;
      for (let j = 0; j < LK; j++) {
        const v = r.m[i * LK + j], k = row + ((j / f) | 0);
        if (v > m[k]) m[k] = v;
      }
    }
    const off = document.createElement("canvas");
    off.width = C; off.height = R;
    const ctx = off.getContext("2d"), img = ctx.createImageData(C, R), px = img.data;
    for (let i = 0; i < R * C; i++) {
      const c = colourIndex(m[i], 0, r.hi);
      px[4 * i] = LUT[c]; px[4 * i + 1] = LUT[c + 1]; px[4 * i + 2] = LUT[c + 2]; px[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    return off;
  }

  // ---- sentence strip --------------------------------------------------------------------
  function buildTokens() {
    const box = $("tokens");
    box.textContent = "";
    const frag = document.createDocumentFragment();
    QT.forEach(function (t, i) {
      const el = document.createElement("span");
      el.className = "tok";
      el.textContent = t;
      el.dataset.i = i;
      el.setAttribute("role", "listitem");
      frag.appendChild(el);
    });
    box.appendChild(frag);
  }

  // Attention from the active query to every key, for colouring the sentence.
  function activeRow(q) {
    const row = new Float32Array(LK);
    if (S.view === "head") {
      const hs = Array.from(S.heads);
      hs.forEach(function (h) { for (let j = 0; j < LK; j++) row[j] += weight(S.layer, h, q, j) / hs.length; });
    } else {
      const r = matrix(S.layer, S.view === "model" ? -1 : S.head);
      for (let j = 0; j < LK; j++) row[j] = r.m[q * LK + j];
    }
    return row;
  }

  function paintTokens() {
    const q = active(), spans = $("tokens").children;
    const row = q === null || LQ !== LK ? null : activeRow(q);
    let hi = 0;
    if (row) for (let j = 0; j < LK; j++) hi = Math.max(hi, row[j]);
    for (let j = 0; j < spans.length; j++) {
      const a = row && hi > 0 ? row[j] / hi : 0;
      spans[j].style.background = a > 0.02 ? "rgba(255, 140, 0, " + a.toFixed(3) + ")" : "";
      spans[j].classList.toggle("query", j === q);
      spans[j].title = row ? QT[q] + " \u2192 " + QT[j] + ": " + fmt(row[j]) : "";
    }
  }

  function pin(i) {
    S.query = S.query === i ? null : i;
    redraw();
  }

  // ---- heat map view ---------------------------------------------------------------------
  const heat = { left: 0, top: 0, cell: 1 };

  function heatGeometry(ctx) {
    let avail = Math.max(320, Math.min(window.innerWidth - 80, 900));
    if (PAT) avail = Math.max(300, Math.min(avail, (window.innerWidth - 200) / 2));
    const fit = avail / Math.max(LQ, LK);
    const cell = fit >= 4 ? Math.min(36, Math.floor(fit)) : Math.max(1, fit);
    let left = 6, top = 6;
    if (cell >= 9) {
      ctx.font = Math.min(13, cell - 2) + "px sans-serif";
      let wq = 0, wk = 0;
      QT.forEach(function (t) { wq = Math.max(wq, ctx.measureText(t).width); });
      KT.forEach(function (t) { wk = Math.max(wk, ctx.measureText(t).width); });
      left = Math.ceil(wq) + 10; top = Math.ceil(wk) + 10;
    }
    return { left: left, top: top, cell: cell, labels: cell >= 9 };
  }

  function drawMatrixCanvas(cv, image, g) {
    const ctx = sizeCanvas(cv, g.left + LK * g.cell + 6, g.top + LQ * g.cell + 6);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, cv.width, cv.height);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(image, g.left, g.top, LK * g.cell, LQ * g.cell);
    const q = active();
    if (g.labels) {
      ctx.font = Math.min(13, g.cell - 2) + "px sans-serif";
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      QT.forEach(function (t, i) {
        ctx.fillStyle = i === q ? "#d1495b" : "#1d2330";
        ctx.fillText(t, g.left - 5, g.top + (i + 0.5) * g.cell);
      });
      ctx.save();
      ctx.textAlign = "left";
      KT.forEach(function (t, j) {
        ctx.save();
        ctx.translate(g.left + (j + 0.5) * g.cell, g.top - 5);
        ctx.rotate(-Math.PI / 2);
        ctx.fillStyle = "#1d2330";
        ctx.fillText(t, 0, 0);
        ctx.restore();
      });
      ctx.restore();
    }
    if (q !== null) {
      ctx.strokeStyle = "#d1495b";
      ctx.lineWidth = Math.max(1.5, Math.min(3, g.cell / 6));
      ctx.strokeRect(g.left - 1, g.top + q * g.cell - 1, LK * g.cell + 2, g.cell + 2);
    }
  }

  function drawHeat() {
    const cv = $("heat");
    const g = heatGeometry(cv.getContext("2d"));
    Object.assign(heat, g);
    const r = matrix(S.layer, S.head);
    drawMatrixCanvas(cv, imageOf(r), g);
    $("cb-lo").textContent = fmt(r.lo);
    $("cb-hi").textContent = fmt(r.hi);
    if (PAT) drawPattern(g);
  }

  function drawColourbar() {
    const cv = $("colorbar"), ctx = cv.getContext("2d");
    for (let x = 0; x < cv.width; x++) {
      const c = colourIndex(x / (cv.width - 1), 0, 1);
      ctx.fillStyle = "rgb(" + LUT[c] + "," + LUT[c + 1] + "," + LUT[c + 2] + ")";
      ctx.fillRect(x, 0, 1, cv.height);
    }
  }

  function drawPattern(g) {
    const off = document.createElement("canvas");
    off.width = LK; off.height = LQ;
    const ctx = off.getContext("2d"), img = ctx.createImageData(LK, LQ), px = img.data;
    for (let i = 0; i < LQ * LK; i++) {
      const on = PAT[i] === 1;
      px[4 * i] = on ? 59 : 238; px[4 * i + 1] = on ? 74 : 238; px[4 * i + 2] = on ? 107 : 238;
      px[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    drawMatrixCanvas($("pattern"), off, g);
  }

  function cellAt(e) {
    const rect = e.target.getBoundingClientRect();
    const j = Math.floor((e.clientX - rect.left - heat.left) / heat.cell);
    const i = Math.floor((e.clientY - rect.top - heat.top) / heat.cell);
    return i >= 0 && i < LQ && j >= 0 && j < LK ? { i: i, j: j } : null;
  }

  function heatMove(e) {
    const c = cellAt(e);
    if (!c) { hideTip(); return; }
    let text = "query " + c.i + " " + QT[c.i] + "\n\u2192 key " + c.j + " " + KT[c.j] + "\n";
    text += S.head < 0 ? "mean over heads: " + fmt(matrix(S.layer, -1).m[c.i * LK + c.j])
                       : "weight: " + fmt(weight(S.layer, S.head, c.i, c.j));
    if (PAT) text += PAT[c.i * LK + c.j] ? "  (allowed)" : "  (blocked by the pattern)";
    showTip(e, text);
  }

  // ---- head view -------------------------------------------------------------------------
  const hv = { rowH: 20, colW: 0, gap: 220, top: 8 };

  function buildChips() {
    const box = $("head-chips");
    box.textContent = "";
    for (let h = 0; h < H; h++) {
      const b = document.createElement("button");
      b.className = "chip";
      b.dataset.h = h;
      const sw = document.createElement("span");
      sw.className = "sw";
      sw.style.background = headColour(h, 1);
      b.appendChild(sw);
      b.appendChild(document.createTextNode("head " + h));
      box.appendChild(b);
    }
    ["all", "none"].forEach(function (name) {
      const b = document.createElement("button");
      b.className = "chip";
      b.dataset.set = name;
      b.textContent = name;
      box.appendChild(b);
    });
  }

  function drawHeadView() {
    const cv = $("lines");
    Array.from($("head-chips").children).forEach(function (b) {
      if (b.dataset.h !== undefined) b.classList.toggle("off", !S.heads.has(+b.dataset.h));
    });
    hv.rowH = LQ > 100 ? 16 : 20;
    let ctx = cv.getContext("2d");
    ctx.font = "13px sans-serif";
    let wmax = 0;
    QT.concat(KT).forEach(function (t) { wmax = Math.max(wmax, ctx.measureText(t).width); });
    hv.colW = Math.ceil(wmax) + 16;
    const width = 2 * hv.colW + hv.gap, height = hv.top * 2 + Math.max(LQ, LK) * hv.rowH;
    ctx = sizeCanvas(cv, width, height);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, height);
    const q = active(), k = S.hoverKey, heads = Array.from(S.heads);
    const x0 = hv.colW, x1 = hv.colW + hv.gap;
    const y = function (i) { return hv.top + (i + 0.5) * hv.rowH; };
    // Highlight boxes: the active query, and keys by their mean weight over the heads shown.
    if (q !== null && heads.length) {
      ctx.fillStyle = "rgba(209, 73, 91, 0.18)";
      ctx.fillRect(2, y(q) - hv.rowH / 2, hv.colW - 4, hv.rowH);
      for (let j = 0; j < LK; j++) {
        let s = 0;
        heads.forEach(function (h) { s += weight(S.layer, h, q, j); });
        s /= heads.length;
        if (s > 0.01) {
          ctx.fillStyle = "rgba(255, 140, 0, " + Math.min(1, s * 1.5).toFixed(3) + ")";
          ctx.fillRect(x1 + 2, y(j) - hv.rowH / 2, hv.colW - 4, hv.rowH);
        }
      }
    }
    // Lines: one per (head, query, key) above a threshold; alpha = weight.
    const thr = q !== null || k !== null ? 0.003 : (LQ > 64 ? 0.08 : 0.02);
    heads.forEach(function (h, n) {
      ctx.strokeStyle = headColour(h, 1);
      // Each head's lines end at its own height within the row, so heads stay apart.
      const dy = heads.length > 1 ? ((n + 0.5) / heads.length - 0.5) * hv.rowH * 0.8 : 0;
      for (let i = 0; i < LQ; i++) {
        if (q !== null && i !== q) continue;
        for (let j = 0; j < LK; j++) {
          if (q === null && k !== null && j !== k) continue;
          const v = weight(S.layer, h, i, j);
          if (v < thr) continue;
          ctx.globalAlpha = Math.min(1, 0.05 + 1.5 * v);
          ctx.lineWidth = 0.5 + 3 * v;
          ctx.beginPath();
          ctx.moveTo(x0, y(i) + dy);
          ctx.lineTo(x1, y(j) + dy);
          ctx.stroke();
        }
      }
    });
    ctx.globalAlpha = 1;
    ctx.font = "13px sans-serif";
    ctx.textBaseline = "middle";
    ctx.fillStyle = "#1d2330";
    ctx.textAlign = "right";
    QT.forEach(function (t, i) {
      ctx.font = (i === q ? "bold " : "") + "13px sans-serif";
      ctx.fillText(t, hv.colW - 8, y(i));
    });
    ctx.textAlign = "left";
    KT.forEach(function (t, j) {
      ctx.font = (j === k ? "bold " : "") + "13px sans-serif";
      ctx.fillText(t, x1 + 8, y(j));
    });
  }

  // Tooltip text: the pinned query's weight on key j in each shown head, largest first.
  function headWeights(q, j) {
    const rows = Array.from(S.heads).map(function (h) { return [h, weight(S.layer, h, q, j)]; });
    rows.sort(function (a, b) { return b[1] - a[1]; });
    return QT[q] + " \u2192 " + KT[j] + " (layer " + S.layer + ")\n" + rows.slice(0, 6)
      .map(function (r) { return "head " + r[0] + ": " + fmt(r[1]); }).join("\n");
  }

  function headTarget(e) {
    const rect = $("lines").getBoundingClientRect();
    const x = e.clientX - rect.left, i = Math.floor((e.clientY - rect.top - hv.top) / hv.rowH);
    if (x < hv.colW && i >= 0 && i < LQ) return { side: "q", i: i };
    if (x > hv.colW + hv.gap && i >= 0 && i < LK) return { side: "k", i: i };
    return null;
  }

  // ---- model view ------------------------------------------------------------------------
  function drawModel() {
    const grid = $("grid");
    grid.textContent = "";
    const avail = Math.max(400, Math.min(window.innerWidth - 60, 1360));
    const t = Math.max(36, Math.min(110, Math.floor((avail - 50) / H) - 6));
    grid.style.gridTemplateColumns = "40px repeat(" + H + ", " + t + "px)";
    grid.appendChild(label(""));
    for (let h = 0; h < H; h++) grid.appendChild(label("head " + h));
    const q = active();
    for (let l = 0; l < N; l++) {
      grid.appendChild(label("layer " + l));
      for (let h = 0; h < H; h++) {
        const cv = document.createElement("canvas");
        cv.dataset.l = l; cv.dataset.h = h;
        cv.title = "layer " + l + ", head " + h;
        const ctx = sizeCanvas(cv, t, t);
        ctx.drawImage(thumbnail(l, h, t), 0, 0, t, t);
        if (q !== null) {
          ctx.strokeStyle = "#d1495b";
          ctx.lineWidth = 1.5;
          ctx.strokeRect(0, (q * t) / LQ, t, Math.max(1.5, t / LQ));
        }
        grid.appendChild(cv);
      }
    }
  }

  // Thumbnails are drawn once per (layer, head, size, boost) and reused on every redraw.
  const thumbs = new Map();
  function thumbnail(l, h, t) {
    const key = l + "," + h + "," + t + "," + S.boost;
    if (!thumbs.has(key)) {
      const dpr = window.devicePixelRatio || 1, c = document.createElement("canvas");
      c.width = c.height = Math.round(t * dpr);
      const ctx = c.getContext("2d");
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(pooledImage(matrix(l, h), c.width), 0, 0, c.width, c.height);
      thumbs.set(key, c);
    }
    return thumbs.get(key);
  }

  function label(text) {
    const el = document.createElement("span");
    el.className = "lab";
    el.textContent = text;
    return el;
  }

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
    if (first) { S.layer = D.layer || 0; S.head = D.head || 0; }
    if (S.layer >= N) S.layer = 0;
    if (S.head >= H) S.head = 0;
    S.query = null; S.hover = null; S.hoverKey = null;
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
    document.querySelectorAll(".tab").forEach(function (b) {
      b.addEventListener("click", function () { setView(b.dataset.view); });
    });
    ["heat", "pattern"].forEach(function (id) {
      const cv = $(id);
      cv.addEventListener("mousemove", heatMove);
      cv.addEventListener("mouseleave", hideTip);
      cv.addEventListener("click", function (e) { const c = cellAt(e); if (c) pin(c.i); });
    });
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
    $("grid").addEventListener("click", function (e) {
      if (e.target.dataset.l === undefined) return;
      S.layer = +e.target.dataset.l; S.head = +e.target.dataset.h;
      $("layer").value = String(S.layer); $("head").value = String(S.head);
      setView("heat");
    });
    document.addEventListener("keydown", function (e) {
      if (["SELECT", "INPUT", "TEXTAREA"].includes(e.target.tagName)) return;
      if (e.key === "Escape") { S.query = null; redraw(); }
      else if (e.key === "ArrowRight" || e.key === "ArrowDown") {
        S.query = S.query === null ? 0 : Math.min(LQ - 1, S.query + 1); redraw();
      } else if (e.key === "ArrowLeft" || e.key === "ArrowUp") {
        S.query = S.query === null ? 0 : Math.max(0, S.query - 1); redraw();
      }
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
})();
