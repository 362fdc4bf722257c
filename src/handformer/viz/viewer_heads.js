/* handformer attention viewer: the head view (lines from the queries to the keys they attend,
   one colour per head) and the model view (every layer x head as a thumbnail).
   Part of the viewer's script (see viewer.js): it uses the state and helpers of viewer.js. */

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

// Thumbnails are drawn once per (layer, head, size, boost, sink) and reused on every redraw.
const thumbs = new Map();
function thumbnail(l, h, t) {
  const key = l + "," + h + "," + t + "," + S.boost + "," + S.sink;
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
