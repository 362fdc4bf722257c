/* handformer attention viewer. Everything it shows comes from the JSON in #hf-data (or from
   window.hfViewer.render(data) with the same JSON, where data.data may also be the weights
   as a Uint8Array); it loads nothing from the network.
   Weights are 8-bit per value, each head scaled to [lo, hi].

   The script is four files, joined in this order inside one function by viz/html.py (so
   they share their top-level names, and the page still holds a single inline script):
     viewer.js           the data shown and what every view draws with: state, decoding,
                         weights, colours, canvas helpers, the sentence strip
     viewer_heat.js      the heat-map view: zoom, pan, colour bar, pattern panel
     viewer_heads.js     the head view and the model view
     viewer_controls.js  tabs, redraw, showing new data, event handlers, render(), start-up */

// The data shown now; setData() replaces all of it (render() draws new data in place).
let D = null, N = 0, H = 0, QT = [], KT = [], LQ = 0, LK = 0, LEVELS = 255;
const $ = (id) => document.getElementById(id);
const S = { view: "heat", layer: 0, head: 0, heads: new Set(),
            query: null, hover: null, hoverKey: null, boost: false, cursor: null,
            sink: false };  // sink: the first key counts in each head's colour scale
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
// The first key is an attention sink in most trained models (heads with nothing to do park
// their weight there): unless S.sink, the colour scale runs to the largest weight on the
// other keys, and the sink's column saturates (self-attention of two tokens or more).
function leavesSink() { return !S.sink && LQ === LK && LK > 1; }

// The top of the colour scale of an (LQ, LK) matrix whose largest value is `top`.
function scaleTop(m, top) {
  if (!leavesSink()) return top;
  let hi = 0;
  for (let i = 0; i < LQ; i++) {
    for (let j = i * LK + 1; j < (i + 1) * LK; j++) if (m[j] > hi) hi = m[j];
  }
  return hi > 0 ? hi : top;
}

// One head's matrix as floats, with its range; h < 0 means the mean over heads.
function matrix(l, h) {
  if (h < 0) return meanMatrix(l);
  const s = D.scale[l * H + h], lo = s[0], k = (s[1] - s[0]) / LEVELS;
  const base = (l * H + h) * LQ * LK, m = new Float32Array(LQ * LK);
  for (let i = 0; i < LQ * LK; i++) m[i] = lo + W[base + i] * k;
  return { m: m, lo: Math.min(0, lo), hi: scaleTop(m, s[1]) };
}

function meanMatrix(l) {
  const key = l + "," + leavesSink();
  if (meanCache.has(key)) return meanCache.get(key);
  const m = new Float32Array(LQ * LK);
  for (let h = 0; h < H; h++) {
    const one = matrix(l, h).m;
    for (let i = 0; i < m.length; i++) m[i] += one[i] / H;
  }
  let lo = 0, hi = 0;
  for (let i = 0; i < m.length; i++) { if (m[i] > hi) hi = m[i]; if (m[i] < lo) lo = m[i]; }
  const r = { m: m, lo: lo, hi: scaleTop(m, hi) };
  meanCache.set(key, r);
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
