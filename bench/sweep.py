"""Benchmark: a folder's worth of documents through a sweep (`runtime.sweep`) against the
scheduler's `--parallel` batches (`runtime.batch`), disk-bound, as issue 42 measures it.

--docs documents of random ids (lengths uniform in --doc-tokens, a fixed seed), each decoding
--gen-tokens past any end token. Experts are read with O_DIRECT through an expert cache of
--cache-share of all experts (far below one token's), the expert files dropped from the page
cache first. Each run's wall time covers every prompt and every generated token; its rate is
generated tokens over that time (the aggregate tok/s of a folder job).

Rows: the scheduler with --baseline slots (0: none), then a sweep of each --windows N. Beside them:
- the disk ceiling: the bytes the largest sweep read over the O_DIRECT read rate measured here
  (`plan.measure_disk_bandwidth`, median of 3), as generated tokens a second;
- the compute ceiling: that sweep again with every expert in RAM (read once, then cached);
- what `colibri plan --docs` predicts for each sweep (`runtime.sweep_plan.sweep_estimate`), from
  compute costs measured first (`plan.measure_costs` at the documents' mean prompt length) and
  the read rate above, and the measured time over it.
Each row's peak RSS is its run's own (the last run's caches collected, VmHWM reset before it).
Writes bench/out/sweep.json.

    python bench/sweep.py --model DIR [--docs 256] [--doc-tokens 100,400] [--gen-tokens 16]
        [--baseline 32] [--windows 32,256] [--cache-share 0.03] [--threads 2] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from colibri.formats.layout import ModelLayout
from colibri.runtime import open_model
from colibri.runtime.expert_store import cache_bytes_for_all
from colibri.runtime.plan import measure_costs, measure_disk_bandwidth
from colibri.runtime.sweep import Sweep
from colibri.runtime.sweep_plan import sweep_estimate

from machine import evict_experts  # bench/machine.py: a script's own folder is first on sys.path

BENCH = Path(__file__).resolve().parent


def documents(vocab: int, count: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, int(n))] for n in rng.integers(shortest, longest + 1, count)]


def run_peak_rss(reset: bool = False) -> int:
    """This process's peak RSS since the last reset (VmHWM; writing 5 to clear_refs resets it)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def run(path: Path, docs: list[list[int]], gen_tokens: int, sweep: bool, slots: int, cache: int, io: str,
        threads: int, scratch: Path | None = None) -> dict:
    """One folder job: the scheduler over `slots` KV slots, or a sweep of a window of `slots`
    (its caches mapped in `scratch`, when given)."""
    gc.collect()  # the last run's caches, before this run's peak is counted
    run_peak_rss(reset=True)
    evict_experts(ModelLayout(path))
    model = open_model(path, threads=threads, ctx=max(map(len, docs)) + gen_tokens, io=io, expert_cache=cache,
                       parallel=1 if sweep and scratch else slots)
    runner = Sweep(model, slots, scratch) if sweep else model.scheduler()
    started = time.perf_counter()
    for doc in docs:
        runner.add(doc, gen_tokens, ignore_eos=True)
    while runner.busy:
        runner.step()
    seconds = time.perf_counter() - started
    stats = runner.stats()
    model.close()
    return {"runner": "sweep" if sweep else "scheduler", "slots": slots,
            "seconds": seconds, "tok_per_s": stats["generated_tokens"] / seconds,
            "prompt_tokens": stats["prompt_tokens"], "generated_tokens": stats["generated_tokens"],
            "expert_misses": stats["expert_misses"], "expert_bytes_read": stats["expert_bytes_read"],
            "read_seconds": stats["read_seconds"], "peak_rss": run_peak_rss()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--doc-tokens", default="100,400", help="shortest,longest prompt in tokens")
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--baseline", type=int, default=32, help="the scheduler's --parallel (0: no scheduler run)")
    parser.add_argument("--windows", default="32,256", help="sweep windows to run")
    parser.add_argument("--cache-share", type=float, default=0.03, help="expert cache as a share of all experts")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--scratch", type=Path, help="the sweeps' --scratch (default: their caches in RAM)")
    args = parser.parse_args()

    layout = ModelLayout(args.model)
    shortest, longest = map(int, args.doc_tokens.split(","))
    docs = documents(layout.config.vocab_size, args.docs, shortest, longest)
    cache = int(cache_bytes_for_all(layout) * args.cache_share)
    windows = [int(w) for w in args.windows.split(",")]
    disk = statistics.median(measure_disk_bandwidth(layout, direct_io=True) for _ in range(3))
    mean_tokens = round(sum(map(len, docs)) / len(docs))
    costs = measure_costs(args.model, threads=args.threads, doc_tokens=mean_tokens)

    def predicted(window: int, expert_cache: int) -> dict:
        return sweep_estimate(layout, costs, args.docs, mean_tokens, args.gen_tokens, window, expert_cache, disk)

    rows = [run(args.model, docs, args.gen_tokens, False, args.baseline, cache, "direct", args.threads)] \
        if args.baseline else []
    rows += [run(args.model, docs, args.gen_tokens, True, w, cache, "direct", args.threads, args.scratch) for w in windows]
    largest = rows[-1]
    compute = run(args.model, docs, args.gen_tokens, True, windows[-1], cache_bytes_for_all(layout), "pread",
                  args.threads, args.scratch)
    generated = largest["generated_tokens"]
    ceilings = {"disk_bytes_per_s": disk, "disk_tok_per_s": generated / (largest["expert_bytes_read"] / disk),
                "compute_tok_per_s": compute["tok_per_s"]}
    base = rows[0]["tok_per_s"] if args.baseline else None
    print(f"{args.docs} documents of {shortest}-{longest} tokens, {args.gen_tokens} generated each, "
          f"{sum(map(len, docs))} prompt tokens; O_DIRECT at {disk / 1e9:.2f} GB/s, expert cache "
          f"{cache / 1e6:.0f} MB ({args.cache_share:.0%}), {args.threads} threads")
    for r in rows[1 if args.baseline else 0:]:
        r["plan"] = predicted(r["slots"], cache)
    compute["plan"] = predicted(windows[-1], cache_bytes_for_all(layout))
    print("| runner | N | seconds | plan's s | measured / plan | gen tok/s | vs scheduler | expert misses | GB read "
          "| plan's GB | read s | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows + [{**compute, "runner": "sweep, experts in RAM"}]:
        plan = r.get("plan")
        seconds, ratio, gb = (f"{plan['seconds']:.1f}", f"{r['seconds'] / plan['seconds']:.2f}",
                              f"{plan['bytes_read'] / 1e9:.2f}") if plan else ("-", "-", "-")
        versus = f"{r['tok_per_s'] / base:.2f}x" if base else "-"
        print(f"| {r['runner']} | {r['slots']} | {r['seconds']:.1f} | {seconds} | {ratio} | {r['tok_per_s']:.2f} "
              f"| {versus} | {r['expert_misses']} | {r['expert_bytes_read'] / 1e9:.2f} | {gb} "
              f"| {r['read_seconds']:.1f} | {r['peak_rss'] / 1e9:.2f} |")
    bound = min(ceilings["disk_tok_per_s"], ceilings["compute_tok_per_s"])
    print(f"N = {largest['slots']}: disk ceiling {ceilings['disk_tok_per_s']:.2f} tok/s, compute ceiling "
          f"{ceilings['compute_tok_per_s']:.2f}; the sweep reached {largest['tok_per_s'] / bound:.2f} of the lower")
    out = BENCH / "out" / "sweep.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "args": vars(args) | {"model": str(args.model)},
                               "rows": rows, "compute": compute, "ceilings": ceilings,
                               "costs": costs}, indent=1, default=str))


if __name__ == "__main__":
    main()
