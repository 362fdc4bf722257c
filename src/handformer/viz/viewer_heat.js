/* handformer attention viewer: the heat-map view (canvas), with its zoom, pan, colour bar
   and pattern panel.
   Part of the viewer's script (see viewer.js): it uses the state and helpers of viewer.js. */

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
