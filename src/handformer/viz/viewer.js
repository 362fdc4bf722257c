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
              query: null, hover: null, hoverKey: null, boost: false, cursor: null };
  let W = null;    // Uint8Array (N * H * LQ * LK)
  let PAT = null;  // Uint8Array (LQ * LK) of 0/1, or null
  let LUT = null;  // 256 x RGB
  let ABL = new Set();  // "layer,head" of the heads ablated in this data (D.ablated)
  const meanCache = new Map();

  function setData(data) {
    D = data;
    N = D.layers; H = D.heads; QT = D.tokens; KT = D.key_tokens || D.tokens;
    LQ = QT.length; LK = KT.length; LEVELS = D.levels || 255;
    LUT = bytes(D.colormap);
    ABL = new Set((D.ablated || []).map(function (p) { return p[0] + "," + p[1]; }));
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
  // Okabe & Ito's colour-blind-safe palette for the first eight heads, then a hue wheel.
  const OKABE_ITO = [[0, 114, 178], [230, 159, 0], [0, 158, 115], [204, 121, 167],
                     [86, 180, 233], [213, 94, 0], [240, 228, 66], [0, 0, 0]];
  function headColour(h, alpha) {
    if (H <= OKABE_ITO.length) {
      const c = OKABE_ITO[h];
      return "rgba(" + c[0] + ", " + c[1] + ", " + c[2] + ", " + alpha + ")";
    }
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
    showRow(S.query);
    redraw();
  }

  // ---- heat map view ---------------------------------------------------------------------
  // Fit (Z.cell = 0): the whole matrix in the panel, labels when a cell is 9 px or more.
  // Zoomed (Z.cell = px per cell): a window of the matrix, panned by dragging, the wheel or the
  // arrow keys; the labels of the rows and columns in view are always drawn.
  const heat = { left: 0, top: 0, cell: 1, x0: 0, y0: 0, cols: 0, rows: 0, labels: false };
  const Z = { cell: 0, x0: 0, y0: 0 };
  const MAX_LABEL = 150;  // px: longer token labels are cut with an ellipsis
  const wide = /[\u1100-\u115f\u2e80-\ua4cf\uac00-\ud7a3\uf900-\ufaff\ufe30-\ufe4f\uff00-\uff60\uffe0-\uffe6]/;

  function labelText(ctx, t) {
    if (ctx.measureText(t).width <= MAX_LABEL) return t;
    let s = t;
    while (s.length > 1 && ctx.measureText(s + "\u2026").width > MAX_LABEL) s = s.slice(0, -1);
    return s + "\u2026";
  }

  // A column label with CJK characters is written top to bottom, characters upright; runs of
  // other characters stay together (as in the PNG pictures).
  function uprightParts(t) {
    const out = [];
    for (const ch of t) {
      if (wide.test(ch) || !out.length || wide.test(out[out.length - 1].slice(-1))) out.push(ch);
      else out[out.length - 1] += ch;
    }
    return out;
  }

  function columnExtent(ctx, t, size) {
    if (!wide.test(t)) return Math.min(MAX_LABEL, ctx.measureText(t).width);
    return uprightParts(t).length * (size + 1);
  }

  function heatAvail() {
    const wrap = $("view-heat");
    const w = wrap && wrap.clientWidth ? wrap.clientWidth : window.innerWidth - 40;
    let avail = Math.max(260, Math.min(w - 10, Z.cell ? 1800 : 900));
    if (PAT) avail = Math.max(240, Math.min(avail, (w - 40) / 2));
    return avail;
  }

  function labelRoom(ctx, size) {
    ctx.font = size + "px sans-serif";
    let wq = 0, wk = 0;
    QT.forEach(function (t) { wq = Math.max(wq, Math.min(MAX_LABEL, ctx.measureText(t).width)); });
    KT.forEach(function (t) { wk = Math.max(wk, columnExtent(ctx, t, size)); });
    return [Math.ceil(wq) + 10, Math.ceil(wk) + 10];
  }

  function heatGeometry(ctx) {
    const avail = heatAvail();
    const fitCell = function (room) {
      const fit = room / Math.max(LQ, LK);
      return fit >= 4 ? Math.min(36, Math.floor(fit)) : Math.max(1, fit);
    };
    let cell = Z.cell || fitCell(avail);
    let size = Math.min(13, Math.floor(cell) - 2);
    let left = 6, top = 6;
    if (cell >= 9) {
      [left, top] = labelRoom(ctx, size);
      if (!Z.cell) {  // fit the labels and the matrix together
        cell = fitCell(avail - left - 6);
        size = Math.min(13, Math.floor(cell) - 2);
        if (cell >= 9) [left, top] = labelRoom(ctx, size);
        else { left = 6; top = 6; }
      }
    }
    const labels = cell >= 9;
    let cols = LK, rows = LQ;
    if (Z.cell) {
      const maxH = Math.max(240, window.innerHeight * 0.72 - top);
      cols = Math.max(1, Math.min(LK, Math.floor((avail - left - 6) / cell)));
      rows = Math.max(1, Math.min(LQ, Math.floor(maxH / cell)));
    }
    Z.x0 = Math.max(0, Math.min(Z.x0, LK - cols));
    Z.y0 = Math.max(0, Math.min(Z.y0, LQ - rows));
    return { left: left, top: top, cell: cell, labels: labels, size: size,
             x0: Z.cell ? Z.x0 : 0, y0: Z.cell ? Z.y0 : 0, cols: cols, rows: rows };
  }

  function drawMatrixCanvas(cv, image, g) {
    const ctx = sizeCanvas(cv, g.left + g.cols * g.cell + 6, g.top + g.rows * g.cell + 6);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, cv.width, cv.height);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(image, g.x0, g.y0, g.cols, g.rows, g.left, g.top, g.cols * g.cell, g.rows * g.cell);
    const q = active(), cur = S.cursor;
    const inRows = function (i) { return i !== null && i >= g.y0 && i < g.y0 + g.rows; };
    const inCols = function (j) { return j !== null && j >= g.x0 && j < g.x0 + g.cols; };
    if (cur) {  // the row and column under the pointer
      ctx.fillStyle = "rgba(255, 255, 255, 0.28)";
      if (inRows(cur.i)) ctx.fillRect(g.left, g.top + (cur.i - g.y0) * g.cell, g.cols * g.cell, g.cell);
      if (inCols(cur.j)) ctx.fillRect(g.left + (cur.j - g.x0) * g.cell, g.top, g.cell, g.rows * g.cell);
    }
    if (g.labels) {
      ctx.font = g.size + "px sans-serif";
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      for (let i = g.y0; i < g.y0 + g.rows; i++) {
        const hot = i === q || (cur && cur.i === i);
        ctx.font = (hot ? "bold " : "") + g.size + "px sans-serif";
        ctx.fillStyle = i === q ? "#c0392b" : "#1d2330";
        ctx.fillText(labelText(ctx, QT[i]), g.left - 5, g.top + (i - g.y0 + 0.5) * g.cell);
      }
      for (let j = g.x0; j < g.x0 + g.cols; j++) {
        const t = KT[j], x = g.left + (j - g.x0 + 0.5) * g.cell;
        ctx.font = (cur && cur.j === j ? "bold " : "") + g.size + "px sans-serif";
        ctx.fillStyle = "#1d2330";
        if (wide.test(t)) {  // upright, top to bottom, ending just above the matrix
          const parts = uprightParts(t), step = g.size + 1;
          ctx.textAlign = "center";
          parts.forEach(function (p, n) {
            ctx.fillText(p, x, g.top - 5 - (parts.length - n - 0.5) * step);
          });
        } else {
          ctx.save();
          ctx.textAlign = "left";
          ctx.translate(x, g.top - 5);
          ctx.rotate(-Math.PI / 2);
          ctx.fillText(labelText(ctx, t), 0, 0);
          ctx.restore();
        }
      }
    }
    if (inRows(q)) {
      ctx.strokeStyle = "#c0392b";
      ctx.lineWidth = Math.max(1.5, Math.min(3, g.cell / 6));
      ctx.strokeRect(g.left - 1, g.top + (q - g.y0) * g.cell - 1, g.cols * g.cell + 2, g.cell + 2);
    }
    if (Z.cell && (g.cols < LK || g.rows < LQ)) {  // where the window lies in the whole matrix
      ctx.fillStyle = "rgba(29, 35, 48, 0.55)";
      const w = g.cols * g.cell, h = g.rows * g.cell;
      ctx.fillRect(g.left + (g.x0 / LK) * w, g.top + h + 2, Math.max(6, (g.cols / LK) * w), 3);
      ctx.fillRect(g.left + w + 2, g.top + (g.y0 / LQ) * h, 3, Math.max(6, (g.rows / LQ) * h));
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
    const zoom = $("zoom-level");
    if (zoom) zoom.textContent = Z.cell ? Math.round(g.cell) + " px per token" : "fit";
    document.body.dataset.heatLabels = g.labels ? "1" : "0";
    document.body.dataset.heatCell = String(Math.round(g.cell * 100) / 100);
    document.body.dataset.heatWindow = [g.y0, g.x0, g.rows, g.cols].join(",");
    const note = $("heat-note");
    if (note) {
      note.textContent = ABL.has(S.layer + "," + S.head)
        ? "This head is ablated: its output is zeroed, so later layers change; its own " +
          "weights are drawn as computed." : "";
    }
    if (PAT) drawPattern(g);
  }

  // Zoom by `factor` around the cell (ci, cj) (default: the middle of the window; from the
  // whole matrix, its start: the first tokens of the text).
  function zoomBy(factor, ci, cj) {
    const g = heat;
    let ai = ci === undefined ? g.y0 + g.rows / 2 : ci, aj = cj === undefined ? g.x0 + g.cols / 2 : cj;
    if (!Z.cell && ci === undefined) { ai = 0; aj = 0; }
    const next = Math.max(2, Math.min(40, (Z.cell || g.cell) * factor));
    const fitCell = heatAvail() / Math.max(LQ, LK);
    if (factor < 1 && next <= fitCell) { zoomFit(); return; }
    const before = (Z.cell || g.cell);
    Z.cell = next;
    // Keep the anchor cell where it was on the screen.
    Z.x0 = Math.round(aj - (aj - g.x0) * before / next);
    Z.y0 = Math.round(ai - (ai - g.y0) * before / next);
    redraw();
  }
  function zoomFit() { Z.cell = 0; Z.x0 = 0; Z.y0 = 0; redraw(); }
  function panBy(di, dj) {
    if (!Z.cell) return false;
    const x0 = Z.x0, y0 = Z.y0;
    Z.x0 = Math.max(0, Math.min(LK - heat.cols, Z.x0 + dj));
    Z.y0 = Math.max(0, Math.min(LQ - heat.rows, Z.y0 + di));
    if (x0 === Z.x0 && y0 === Z.y0) return false;
    redraw();
    return true;
  }
  // Pan so query row i is in view (arrow keys, clicks on the sentence).
  function showRow(i) {
    if (!Z.cell || i === null) return;
    if (i < Z.y0) Z.y0 = i;
    else if (i >= Z.y0 + heat.rows) Z.y0 = i - heat.rows + 1;
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
    const x = Math.floor((e.clientX - rect.left - heat.left) / heat.cell);
    const y = Math.floor((e.clientY - rect.top - heat.top) / heat.cell);
    if (x < 0 || y < 0 || x >= heat.cols || y >= heat.rows) return null;
    const i = y + heat.y0, j = x + heat.x0;
    return i >= 0 && i < LQ && j >= 0 && j < LK ? { i: i, j: j } : null;
  }

  function heatMove(e) {
    const c = cellAt(e);
    const was = S.cursor;
    S.cursor = c;
    if (!c) { hideTip(); if (was) redraw(); return; }
    if (!was || was.i !== c.i || was.j !== c.j) redraw();
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
        const off = ABL.has(l + "," + h);
        cv.title = "layer " + l + ", head " + h + (off ? " (ablated)" : "");
        cv.tabIndex = 0;
        cv.setAttribute("role", "button");
        cv.setAttribute("aria-label", cv.title + ": open in the heat map");
        const ctx = sizeCanvas(cv, t, t);
        ctx.drawImage(thumbnail(l, h, t), 0, 0, t, t);
        if (off) {  // ablated: greyed and struck through
          cv.classList.add("ablated");
          ctx.fillStyle = "rgba(255, 255, 255, 0.55)";
          ctx.fillRect(0, 0, t, t);
          ctx.strokeStyle = "#1d2330";
          ctx.lineWidth = 2;
          ctx.beginPath(); ctx.moveTo(3, 3); ctx.lineTo(t - 3, t - 3);
          ctx.moveTo(t - 3, 3); ctx.lineTo(3, t - 3); ctx.stroke();
        }
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
})();
