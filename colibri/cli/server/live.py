"""The live page at `/`: what the engine is doing, refreshed every second.

Plain HTML with a little script and no build step or fetch outside this server: it polls
`/live.json` (sequences running and queued, aggregate tok/s, hit rate, expert bytes read; the
routing of the last RECENT_STEPS engine steps as a layer × expert heat map, and the last
HISTORY_SECONDS of tok/s, hit rate and MB/s as time charts, both drawn here as SVG by
`colibri.cli.charts`) and, every few seconds, `/v1/batches` (the Batch API's jobs and their
progress). With `--api-key` the page asks for the key once and sends it as the API does.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from colibri.cli.charts import heat_svg, line_svg

RECENT_STEPS = 64  # engine steps whose routing the heat map shows
HISTORY_SECONDS = 300  # the time charts' span
SAMPLE_SECONDS = 2.0  # between two points of the time charts


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


class History:
    """The engine's rates over the last HISTORY_SECONDS, one point every SAMPLE_SECONDS: tok/s
    generated, the expert hit rate of the lookups in between (None without any) and MB/s read."""

    def __init__(self, engine, every: float = SAMPLE_SECONDS):
        self.engine, self.every = engine, every
        self.points: deque = deque(maxlen=int(HISTORY_SECONDS / every))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="colibri-live-history", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _totals(self) -> tuple[float, int, int, int, int]:
        store = self.engine.model.store.stats()
        return (time.monotonic(), self.engine.scheduler.counters["generated_tokens"], store["expert_hits"],
                store["expert_misses"], store["expert_bytes_read"])

    def _run(self) -> None:
        last = self._totals()
        while not self.stopping.wait(self.every):
            now = self._totals()
            seconds, tokens, hits, misses, read = (b - a for a, b in zip(last, now))
            self.points.append((now[0], tokens / seconds, hits / (hits + misses) if hits + misses else None,
                                read / 1e6 / seconds))
            last = now

    def charts(self) -> list[str]:
        points = list(self.points)
        now = time.monotonic()
        ago = [round(t - now, 1) for t, *_ in points]
        return [line_svg(ident, [(name, [p[k] for p in points])], name, "seconds ago", x_values=ago, width=440,
                         height=160)
                for ident, name, k in (("history-rate", "tok/s", 1), ("history-hits", "expert hit rate", 2),
                                       ("history-read", "expert MB read/s", 3))]


def live_numbers(engine, routing: RecentRouting, history: History) -> dict:
    """`/live.json`: the engine's numbers (`/metrics`' own), the recent routing and the charts."""
    from colibri.cli.server.metrics import engine_numbers

    counts = routing.counts()
    return {**engine_numbers(engine), "heat": {"layers": routing.layers, "counts": counts, "steps": RECENT_STEPS},
            "charts": {"heat": heat_svg(routing.layers, np.array(counts, np.int64), height=280),
                       "history": history.charts()}}


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
<div id="heat-box"></div>
<h2>The last minutes</h2><div id="history" class="cards"></div>
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
    document.getElementById("heat-box").innerHTML = now.charts.heat;  // drawn by the server
    document.getElementById("history").innerHTML = now.charts.history.join("");
    document.getElementById("steps").textContent = now.heat.steps;
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
