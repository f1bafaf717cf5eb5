"""`colibri report TRACE.jsonl [--stats RUN.json] -o report.html`: what a run did, in one file.

The report is self-contained HTML (inline SVG drawn here, no script, no font or link to
fetch): a layer × expert heat map of the trace's routing counts; the expert cache's hit rate
and the bytes it read per token over the run, replayed through the runtime's own cache index
at the run's cache size; the policy replay (`runtime.policy_replay`, as `bench/policy.py`
prints it) at several cache sizes beside Belady's optimum, so a bigger cache or another policy
can be judged before buying RAM; and, given the stats a `colibri run --prompt-dir --stats`
job wrote, the tokens generated over the job against the plan's ceiling.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from colibri.cli.charts import heat_svg, line_svg
from colibri.formats.layout import write_atomic
from colibri.runtime.expert_store import POLICIES, CacheIndex
from colibri.runtime.policy_replay import policy_table, step_requests, steps_of

WINDOW = 16  # tokens the hit rate over time is averaged over


class ReportError(ValueError):
    """A trace or stats file that cannot be reported; the message names it."""


def read_records(path: Path) -> list[dict]:
    """The trace's lines ({"step", "row", "layer", "experts", "actor"}; step and row None in a
    trace written before they were, actor None but in a Ray job's), checked."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                layer, experts = int(record["layer"]), [int(e) for e in record["experts"]]
                step, row = (None, None) if "step" not in record else (int(record["step"]), int(record["row"]))
                actor = None if record.get("actor") is None else int(record["actor"])
            except (ValueError, KeyError, TypeError) as e:
                raise ReportError(f"{path}: line {number} is not a routing record ({type(e).__name__}: {e})") from None
            if layer < 0 or any(e < 0 for e in experts) or (step is not None and (step < 0 or not 0 <= row < 1 << 20)):
                raise ReportError(f"{path}: line {number} has a negative layer, expert, step or row")
            records.append({"step": step, "row": row, "layer": layer, "experts": experts, "actor": actor})
    if not records:
        raise ReportError(f"{path}: no routing records (write one with colibri run --trace-routing)")
    return records


def heat_counts(records: list[dict]) -> tuple[list[int], np.ndarray]:
    """(the MoE layers in order, counts [layer, expert]: how often each expert was chosen)."""
    layers = sorted({r["layer"] for r in records})
    row = {layer: i for i, layer in enumerate(layers)}
    counts = np.zeros((len(layers), max(e for r in records for e in r["experts"]) + 1), np.int64)
    for r in records:
        np.add.at(counts[row[r["layer"]]], r["experts"], 1)
    return layers, counts


def hit_rate_over_time(steps, capacity: int, policy: str = "lru") -> tuple[list[float], list[float]]:
    """Per token (a row of a step): its step's hit rate and its share of the step's misses,
    the steps' requests (`step_requests`) replayed at `capacity` experts."""
    index, rates, misses = CacheIndex(capacity, policy), [], []
    for step in steps:
        hits, missed = index.hits, index.misses
        for request in step_requests(step):
            index.place(request)
        lookups = index.hits - hits + index.misses - missed
        rates += [(index.hits - hits) / max(lookups, 1)] * len(step)
        misses += [(index.misses - missed) / len(step)] * len(step)
    return rates, misses


def build_report(trace: Path, stats: dict | None = None) -> tuple[str, dict]:
    """(the HTML, the numbers drawn in it)."""
    records = read_records(trace)
    layers, counts = heat_counts(records)
    steps = steps_of(records)
    tokens = [row for step in steps for row in step]
    requests = [request for step in steps for request in step_requests(step)]
    distinct = int(np.count_nonzero(counts))
    capacity = int(stats["stats"]["expert_cache_slots"]) if stats else max(1, distinct // 4)
    rates, misses = hit_rate_over_time(steps, capacity)
    per_miss = stats["stats"]["expert_bytes_read"] / max(stats["stats"]["expert_misses"], 1) if stats else None
    numbers = {"layers": layers, "counts": counts.tolist(), "tokens": len(tokens), "cache_experts": capacity,
               "hit_rate_per_token": rates, "misses_per_token": misses,
               "policies": policy_table(requests)}
    window = [float(np.mean(rates[max(0, i - WINDOW + 1):i + 1])) for i in range(len(rates))]
    parts = [f"<h1>colibri report: {html.escape(trace.name)}</h1>",
             f"<p>{len(tokens)} tokens × {len(layers)} MoE layers, {distinct} distinct experts chosen.</p>",
             *_actors_note(records),
             "<h2>Routing: how often each expert was chosen</h2>", heat_svg(layers, counts),
             f"<h2>Expert cache over the run (LRU replay at {capacity} experts)</h2>",
             line_svg("hit-rate", [(f"hit rate, mean of {WINDOW} tokens", window)], "hit rate", "token"),
             line_svg("bytes-read", [("MB read per token" if per_miss else "misses per token",
                                      [m * per_miss / 1e6 if per_miss else m for m in misses])],
                      "MB read per token" if per_miss else "expert misses per token", "token"),
             "<h2>What another cache size or policy would give (replay of this trace)</h2>",
             _policy_html(numbers["policies"])]
    if stats:
        parts += _job_html(stats, numbers)
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>colibri report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:1000px}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>"
            + "".join(parts) + "</body></html>")
    return page, numbers


def _actors_note(records: list[dict]) -> list[str]:
    actors = {r["actor"] for r in records if r["actor"] is not None}
    if len(actors) < 2:
        return []
    return [f"<p>This trace comes from {len(actors)} Ray actors, each with its own expert cache; the replays "
            "below treat it as one cache, so their hit rates are not the actors'.</p>"]


def _policy_html(rows: list[dict]) -> str:
    head = "".join(f"<th>{p}</th>" for p in POLICIES)
    body = "".join(f"<tr><td>{r['cache_share']:.0%} ({r['cache_experts']} experts)</td>"
                   + "".join(f"<td>{r[p]:.1%}</td>" for p in POLICIES) + f"<td>{r['belady']:.1%}</td></tr>" for r in rows)
    return f'<table id="policies"><tr><th>cache</th>{head}<th>Belady (best possible)</th></tr>{body}</table>'


def _job_html(stats: dict, numbers: dict) -> list[str]:
    """The job's tokens over time, its tok/s and the plan's ceiling for its batch size."""
    documents = sorted(stats.get("documents", {}).values(), key=lambda d: d.get("finished_s") or 0)
    done, total = [], 0
    for d in documents:
        total += d["generated_tokens"]
        done.append(total)
    seconds = max((d.get("finished_s") or 0 for d in documents), default=0)
    rate = total / seconds if seconds else None
    plan = stats.get("plan") or {}
    numbers.update(job_tok_per_s=rate, plan=plan)
    predicted = plan.get("memory_ceiling_tok_per_s")
    line = (f"<p>{len(documents)} documents, {total} tokens generated in {seconds:.0f} s: "
            f"<b>{rate:.2f} tok/s</b>" if rate else "<p>no documents finished") + (
        f"; the plan's ceiling for {plan.get('batch')} sequences at once: {predicted:.2f} tok/s in RAM"
        + (f", {plan['disk_ceiling_tok_per_s']:.2f} disk-bound" if plan.get("disk_ceiling_tok_per_s") else "")
        if predicted else "") + ".</p>"
    return ["<h2>The job</h2>", line,
            line_svg("job-tokens", [("tokens generated by the documents finished", [float(v) for v in done])],
                     "tokens", "seconds into the job", x_values=[d.get("finished_s") or 0 for d in documents])]


def report_command(args) -> int:
    stats = None
    if args.stats:
        try:
            stats = json.loads(Path(args.stats).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"colibri report: error: {args.stats}: {e}") from None
        if not isinstance(stats, dict) or not isinstance(stats.get("stats"), dict) \
                or not isinstance(stats["stats"].get("expert_cache_slots"), int):
            raise SystemExit(f"colibri report: error: {args.stats}: not the stats a colibri run --prompt-dir --stats wrote")
    try:
        page, _ = build_report(Path(args.trace), stats)
    except (OSError, ReportError) as e:
        raise SystemExit(f"colibri report: error: {e}") from None
    write_atomic(Path(args.output), page.encode("utf-8"))
    print(f"report written to {args.output}")
    return 0
