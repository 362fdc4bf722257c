/* handformer rollout view: drawn from D.rollout in #hf-data when the page has one
   (handformer viz --rollout). Separate from the viewer's script (viewer.js and its parts):
   it adds its own section after <main>.
   The rollout matrix is 8-bit, scaled to [0, hi]; raw, rollout and flow rows are floats. */
"use strict";
(function () {
  const node = document.getElementById("hf-data");
  if (!node) return;
  const D = JSON.parse(node.textContent);
  const R = D.rollout;
  if (!R) return;
  const T = D.tokens, L = T.length;

  function bytes(b64) {
    const bin = atob(b64), out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  const M = bytes(R.matrix), LUT = bytes(D.colormap);
  const value = function (i, j) { return M[i * L + j] * R.hi / 255; };
  let row = R.row;

  const style = document.createElement("style");
  style.textContent = ".rollout h2 { font-size: 1.1rem; margin: 18px 0 4px; }" +
    ".rollout-bars { border-collapse: collapse; font-size: 0.8rem; }" +
    ".rollout-bars td, .rollout-bars th { padding: 0 6px; text-align: left; }" +
    ".rollout-bars .bar { display: inline-block; height: 9px; border-radius: 2px; }" +
    "#rollout-heat { cursor: pointer; border: 1px solid #d9dde6; }";
  document.head.appendChild(style);
  const section = document.createElement("section");
  section.id = "view-rollout";
  section.className = "rollout";
  section.innerHTML =
    "<h2>Attention rollout</h2>" +
    "<p class=\"muted\">Rollout (Abnar &amp; Zuidema 2020) follows attention down through " +
    "every layer, the residual connection included: row <i>i</i> is how much output " +
    "position <i>i</i> draws on each input token. Click a row to compare raw attention " +
    "(last layer, heads averaged), rollout and attention flow for it.</p>" +
    "<div class=\"panels\"><figure class=\"panel\"><canvas id=\"rollout-heat\" " +
    "aria-label=\"rollout matrix\"></canvas></figure>" +
    "<figure class=\"panel\"><div id=\"rollout-title\"></div>" +
    "<table id=\"rollout-bars\" class=\"rollout-bars\"></table></figure></div>";
  const main = document.querySelector("main");
  (main ? main.parentNode : document.body).insertBefore(section, main ? main.nextSibling : null);

  const cell = Math.max(3, Math.min(14, Math.floor(520 / L)));
  const cv = document.getElementById("rollout-heat");
  const ratio = window.devicePixelRatio || 1;
  cv.width = L * cell * ratio; cv.height = L * cell * ratio;
  cv.style.width = (L * cell) + "px"; cv.style.height = (L * cell) + "px";

  function draw() {
    const ctx = cv.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    for (let i = 0; i < L; i++) {
      for (let j = 0; j < L; j++) {
        const c = M[i * L + j] * 3;
        ctx.fillStyle = "rgb(" + LUT[c] + "," + LUT[c + 1] + "," + LUT[c + 2] + ")";
        ctx.fillRect(j * cell, i * cell, cell, cell);
      }
    }
    ctx.strokeStyle = "#d1495b"; ctx.lineWidth = 2;
    ctx.strokeRect(1, row * cell + 1, L * cell - 2, cell - 2);
  }

  function series() {
    const out = [];
    if (R.raw && row === R.row) out.push(["raw attention", R.raw, "#9e9e9e"]);
    const roll = []; for (let j = 0; j < L; j++) roll.push(value(row, j));
    out.push(["rollout", row === R.row && R.rollout_row ? R.rollout_row : roll, "#3b6fb6"]);
    if (R.flow && row === R.row) out.push(["flow", R.flow, "#d9822b"]);
    return out;
  }

  function bars() {
    const s = series();
    document.getElementById("rollout-title").textContent = "Output position " + row + " (" +
      T[row] + "): each method scaled to its maximum" +
      (row === R.row ? "" : "; raw attention and flow are for position " + R.row + " only");
    const table = document.getElementById("rollout-bars");
    table.innerHTML = "";
    const head = document.createElement("tr");
    head.innerHTML = "<th>token</th>" + s.map(function (x) {
      return "<th style=\"color:" + x[2] + "\">" + x[0] + "</th>"; }).join("");
    table.appendChild(head);
    const peaks = s.map(function (x) { return Math.max.apply(null, x[1]) || 1; });
    for (let j = 0; j < L; j++) {
      const tr = document.createElement("tr");
      const name = document.createElement("td");
      name.className = "tok"; name.textContent = T[j];
      tr.appendChild(name);
      s.forEach(function (x, k) {
        const td = document.createElement("td");
        const bar = document.createElement("span");
        bar.className = "bar";
        bar.style.width = Math.round(80 * x[1][j] / peaks[k]) + "px";
        bar.style.background = x[2];
        td.title = x[0] + ": " + x[1][j].toFixed(4);
        td.appendChild(bar);
        tr.appendChild(td);
      });
      table.appendChild(tr);
    }
  }

  cv.addEventListener("click", function (e) {
    const box = cv.getBoundingClientRect();
    const i = Math.floor((e.clientY - box.top) / cell);
    if (i >= 0 && i < L) { row = i; draw(); bars(); }
  });
  draw();
  bars();
})();
