"""The live page at `/`: what the engine is doing, refreshed every second.

Plain HTML with a little script and no build step or fetch outside this server: it polls
`/live.json` (sequences running and queued, aggregate tok/s, hit rate, expert bytes read, and
the routing of the last RECENT_STEPS engine steps as a layer × expert heat map) and, every
few seconds, `/v1/batches` (the Batch API's jobs and their progress). With `--api-key` the
page asks for the key once and sends it as the API does.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

RECENT_STEPS = 64  # engine steps whose routing the heat map shows


class RecentRouting:
    """The experts each MoE layer chose in the last RECENT_STEPS steps (a decoder `route_log`)."""

    def __init__(self, moe_layers: list[int], n_experts: int):
        self.layers, self.n_experts = list(moe_layers), n_experts
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.recent: deque = deque(maxlen=RECENT_STEPS * max(len(self.layers), 1))
        self.lock = threading.Lock()

    def __call__(self, layer, positions, ids, weights) -> None:
        with self.lock:
            self.recent.append((self.row[layer], np.array(ids, np.int64).reshape(-1)))

    def counts(self) -> list[list[int]]:
        """[layer][expert] choices over the recent steps."""
        counts = np.zeros((len(self.layers), self.n_experts), np.int64)
        with self.lock:
            recent = list(self.recent)
        for row, experts in recent:
            np.add.at(counts[row], experts, 1)
        return counts.tolist()


def live_numbers(engine, routing: RecentRouting) -> dict:
    """`/live.json`: the engine's numbers (`/metrics`' own) and the recent routing."""
    from colibri.cli.server.metrics import engine_numbers

    return {**engine_numbers(engine), "heat": {"layers": routing.layers, "counts": routing.counts(), "steps": RECENT_STEPS}}


PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>colibri</title><style>
body{font-family:sans-serif;margin:1.5em;max-width:1000px}
.cards{display:flex;gap:1em;flex-wrap:wrap}.card{border:1px solid #ccc;padding:.5em 1em;min-width:9em}
.card b{display:block;font-size:1.6em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}
</style></head><body>
<h1>colibri <span id="model"></span></h1>
<div class="cards">
<div class="card">running<b id="active">-</b></div><div class="card">queued<b id="queued">-</b></div>
<div class="card">tok/s (aggregate)<b id="rate">-</b></div><div class="card">expert hit rate<b id="hits">-</b></div>
<div class="card">expert MB read/s<b id="read">-</b></div><div class="card">tokens generated<b id="generated">-</b></div>
</div>
<h2>Routing of the last <span id="steps"></span> steps (layer × expert)</h2>
<svg id="heat-map" width="940" height="300" role="img" aria-label="routing heat map"></svg>
<h2>Batch jobs</h2><table id="batches"><tr><th>batch</th><th>status</th><th>done</th><th>failed</th><th>total</th></tr></table>
<p id="error" style="color:#c0392b"></p>
<script>
"use strict";
const key = () => sessionStorage.getItem("colibri-key");
async function get(path) {
  const headers = key() ? {"Authorization": "Bearer " + key()} : {};
  const reply = await fetch(path, {headers});
  if (reply.status === 401) {
    sessionStorage.setItem("colibri-key", prompt("API key") || "");
    throw new Error("the server needs its API key");
  }
  if (!reply.ok) throw new Error(path + ": HTTP " + reply.status);
  return reply.json();
}
let last = null;
function heat(h) {
  const svg = document.getElementById("heat-map"), rows = h.counts.length, cols = rows ? h.counts[0].length : 0;
  const w = Math.max(2, Math.floor(900 / Math.max(cols, 1))), r = Math.max(3, Math.floor(280 / Math.max(rows, 1)));
  const top = Math.max(1, ...h.counts.flat());
  const cells = [`<rect x="40" y="0" width="${w * cols}" height="${r * rows}" fill="white" stroke="#ccc"/>`];
  h.counts.forEach((row, i) => row.forEach((n, e) => {
    if (!n) return;
    const shade = Math.round(255 - 215 * Math.log1p(n) / Math.log1p(top));
    cells.push(`<rect x="${40 + e * w}" y="${i * r}" width="${w}" height="${r}" fill="rgb(${shade},${shade},255)">` +
               `<title>layer ${h.layers[i]} expert ${e}: ${n}</title></rect>`);
  }));
  h.layers.forEach((layer, i) => {  // the axes: each layer's number, then the experts' span
    if (rows <= 64 || i % 4 === 0)
      cells.push(`<text x="36" y="${i * r + Math.floor((r + Math.min(r, 10)) / 2)}" font-size="${Math.min(r, 10)}" text-anchor="end">${layer}</text>`);
  });
  cells.push(`<text x="40" y="${r * rows + 13}" font-size="11">expert 0 .. ${cols - 1} →</text>`);
  svg.setAttribute("height", String(r * rows + 18));
  svg.innerHTML = cells.join("");
  document.getElementById("steps").textContent = h.steps;
}
async function tick() {
  try {
    const now = await get("/live.json"), t = performance.now();
    for (const [id, value] of [["active", now.active + " / " + now.slots], ["queued", now.queued],
        ["rate", now.tok_per_s.toFixed(2)], ["hits", (100 * now.expert_hit_rate).toFixed(1) + "%"],
        ["generated", now.generated_tokens]])
      document.getElementById(id).textContent = value;
    if (last) document.getElementById("read").textContent =
      ((now.expert_bytes_read - last.now.expert_bytes_read) / 1e6 / ((t - last.t) / 1000)).toFixed(1);
    last = {now, t};
    heat(now.heat);
    document.getElementById("error").textContent = "";
  } catch (error) { document.getElementById("error").textContent = String(error); }
}
async function batches() {
  try {
    const list = await get("/v1/batches?limit=20");
    const rows = list.data.map(b => `<tr><td>${b.id}</td><td>${b.status}</td><td>${b.request_counts.completed}</td>` +
                                    `<td>${b.request_counts.failed}</td><td>${b.request_counts.total}</td></tr>`);
    document.getElementById("batches").innerHTML =
      "<tr><th>batch</th><th>status</th><th>done</th><th>failed</th><th>total</th></tr>" + rows.join("");
  } catch (error) { /* no Batch API on this server */ }
}
tick(); batches(); setInterval(tick, 1000); setInterval(batches, 5000);
</script></body></html>
"""
