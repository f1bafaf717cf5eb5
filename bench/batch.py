"""Benchmark: aggregate decode tok/s of B sequences decoded together (`runtime.batch`).

For each B, B prompts of --prompt-tokens tokens are read (random ids, or with --text consecutive
windows of a text, for a trained model's real routing), then --tokens are decoded for each; only
the steps where every sequence decodes are timed. Distinct experts a step reads are printed
beside what uniform, independent routing would read.

(a) disk-bound (`--modes disk`): O_DIRECT, an expert cache of --cache-share of the experts,
    the expert files dropped from the page cache first. Printed next to the batch ceiling
    disk_bw × B / (distinct expert bytes per step) (B: the tokens a step made), disk_bw measured as the store reads (O_DIRECT,
    one expert record per read, several in flight; median of 3), and next to B = 1.
(b) in RAM (`--modes ram`): every expert cached, warm. Printed next to what `colibri plan
    --measure-speed` expects (`plan.measure_costs`, measured in the same run), to llama.cpp's
    `llama-batched-bench` (S_TG, aggregate) on the same weights, when --llama-bin is given
    (the GGUF `colibri export-gguf` writes, -npp/-ntg as here, -t --threads), run in the same
    session, and next to the memory ceiling at B = 1.

Each row also says where a step's time goes: expert reads (waited for) and the rest (compute),
and the read bandwidth reached while waiting (bytes read / time waited: above disk_bw when the
reads overlap compute or the host caches the disk).
Writes bench/out/batch.json.

    python bench/batch.py --model DIR [--batches 1,2,4,8,16,32,64] [--modes ram,disk]
        [--tokens 32] [--prompt-tokens 16] [--cache-share 0.03] [--llama-bin DIR] [--text FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from colibri.formats.layout import ModelLayout
from colibri.runtime import open_model
from colibri.runtime.expert_store import cache_bytes_for_all
from colibri.runtime.memory import current_rss
from colibri.runtime.plan import measure_costs, measure_disk_bandwidth, step_seconds

from machine import evict_experts, read_bandwidth  # bench/machine.py: a script's own folder is first on sys.path

BENCH = Path(__file__).resolve().parent


def prompts_of(model, batch: int, prompt_tokens: int, text: Path | None, seed: int = 0) -> list[list[int]]:
    """`batch` prompts: consecutive windows of `text`'s tokens, else random ids."""
    if text is not None:
        ids = model.tokenizer.encode(text.read_text(encoding="utf-8"))
        if len(ids) < batch * prompt_tokens:
            raise SystemExit(f"{text}: {len(ids)} tokens, fewer than {batch} prompts of {prompt_tokens}")
        return [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(batch)]
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, model.config.vocab_size, prompt_tokens)] for _ in range(batch)]


def decode_batch(model, batch: int, prompt_tokens: int, tokens: int, text: Path | None = None) -> dict:
    """Aggregate numbers of the steps where all `batch` sequences decode."""
    scheduler = model.scheduler()
    for prompt in prompts_of(model, batch, prompt_tokens, text):
        scheduler.add(prompt, tokens, ignore_eos=True)
    store = model.store
    timed = dict(seconds=0.0, tokens=0, steps=0, distinct=0, read_bytes=0, read_wait=0.0)
    while scheduler.busy:
        decoding = all(s.decoding for s in scheduler.running) and not scheduler.queue
        before = store.bytes_read, store.counters["waited_seconds"], time.perf_counter()
        events = scheduler.step()
        if decoding:
            timed["seconds"] += time.perf_counter() - before[2]
            timed["tokens"] += sum(e.token is not None for e in events)
            timed["steps"] += 1
            timed["distinct"] += model.decoder.distinct_experts()
            timed["read_bytes"] += store.bytes_read - before[0]
            timed["read_wait"] += store.counters["waited_seconds"] - before[1]
    steps = max(timed["steps"], 1)
    return {"rss": current_rss(), "ram_budget": model.budget.ram, "batch": batch, "tok_per_s": timed["tokens"] / timed["seconds"], "steps": timed["steps"],
            "distinct_experts_per_step": timed["distinct"] / steps, "read_bytes_per_step": timed["read_bytes"] / steps,
            "read_wait_share": timed["read_wait"] / timed["seconds"], "tokens_per_step": timed["tokens"] / steps,
            "read_bw_while_waiting": timed["read_bytes"] / timed["read_wait"] if timed["read_wait"] else None, "step_ms": 1e3 * timed["seconds"] / steps,
            "hit_rate": model.store.stats()["expert_hit_rate"]}


def uniform_union(c, batch: int) -> float:
    """Distinct experts a step of `batch` tokens would read, summed over the MoE layers, were each
    token's top-k uniform and independent: E·(1 − (1 − k/E)^B) a layer."""
    return len(c.moe_layers) * c.n_experts * (1 - (1 - c.n_experts_used / c.n_experts) ** batch)


def llama_batched_bench(llama_bin: Path, gguf: Path, batches: list[int], prompt_tokens: int, tokens: int,
                        threads: int) -> dict[int, float]:
    """{B: aggregate decode tok/s (S_TG)} from llama.cpp's llama-batched-bench."""
    ctx = max(batches) * (prompt_tokens + tokens) + 64
    cmd = [str(llama_bin / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_tokens), "-ntg", str(tokens), "-npl", ",".join(map(str, batches)), "-t", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rates = {}
    for line in out.splitlines():  # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[2] or "x"):
            rates[int(cells[2])] = float(cells[7])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--modes", default="ram,disk")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per sequence (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens per sequence (default: %(default)s)")
    parser.add_argument("--cache-share", type=float, default=0.03, help="disk mode: expert cache as a share of all experts")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--ram-budget", default=None, help="disk mode: --ram-budget of the runs (default: 80%% of RAM)")
    parser.add_argument("--llama-bin", type=Path, help="folder with llama.cpp's llama-batched-bench")
    parser.add_argument("--gguf", type=Path, help="the model as GGUF (default: exported next to bench/out)")
    parser.add_argument("--text", type=Path, help="prompts from this text's tokens (a trained model's real routing), "
                                                  "not random ids")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")

    layout = ModelLayout(args.model)
    c = layout.config
    all_experts = cache_bytes_for_all(layout)
    expert_bytes = {layer: t.expert_bytes for layer, t in layout.expert_layers.items()}
    per_expert = sum(expert_bytes.values()) / len(expert_bytes)
    resident = sum(t.nbytes for t in layout.tensors.values())
    ctx = args.prompt_tokens + args.tokens + 8
    results = {"model": str(args.model), "date": time.strftime("%Y-%m-%d"), "threads": args.threads,
               "tokens": args.tokens, "prompt_tokens": args.prompt_tokens}

    if "ram" in modes:
        mem_bw = read_bandwidth(args.threads)
        per_token = resident + sum(b * c.n_experts_used for b in expert_bytes.values())
        results["memory_read_bw"], results["ram_ceiling_b1"] = mem_bw, mem_bw / per_token
        llama = {}
        if args.llama_bin:
            gguf = args.gguf or BENCH / "out" / f"{args.model.name}.gguf"
            if not gguf.exists():
                subprocess.run([sys.executable, "-m", "colibri.cli", "export-gguf", str(args.model), str(gguf)], check=True)
            llama = llama_batched_bench(args.llama_bin, gguf, [b for b in batches if b <= 32], args.prompt_tokens,
                                        args.tokens, args.threads)
        costs = results["costs"] = measure_costs(args.model, threads=args.threads)
        model = open_model(args.model, threads=args.threads, ctx=ctx, expert_cache=all_experts, parallel=max(batches))
        decode_batch(model, max(batches), args.prompt_tokens, 4, args.text)  # warm: kernels compiled, experts cached
        rows = []
        for b in batches:
            r = decode_batch(model, b, args.prompt_tokens, args.tokens, args.text)
            r["llama_batched_bench"] = llama.get(b)
            r["uniform_distinct_per_step"] = uniform_union(c, b)
            r["plan_tok_per_s"] = b / step_seconds(costs, r["uniform_distinct_per_step"], b)
            rows.append(r)
        model.close()
        results["ram"] = rows
        print(f"\nin RAM, {args.model.name}: read bw {mem_bw / 1e9:.1f} GB/s, B=1 memory ceiling "
              f"{results['ram_ceiling_b1']:.1f} tok/s; the plan's expected tok/s and llama-batched-bench S_TG beside")
        print(f"{'B':>4}{'tok/s':>9}{'vs B=1':>8}{'plan':>8}{'of it':>7}{'llama':>9}{'ratio':>7}{'experts/step':>14}"
              f"{'if uniform':>11}{'step ms':>9}")
        for r in rows:
            lr = r["llama_batched_bench"]
            theirs, ratio = ("-", "-") if lr is None else (f"{lr:.2f}", f"{r['tok_per_s'] / lr:.2f}x")
            print(f"{r['batch']:>4}{r['tok_per_s']:>9.2f}{r['tok_per_s'] / rows[0]['tok_per_s']:>7.2f}x"
                  f"{r['plan_tok_per_s']:>8.2f}{r['tok_per_s'] / r['plan_tok_per_s']:>7.2f}{theirs:>9}{ratio:>7}{r['distinct_experts_per_step']:>14.1f}{r['uniform_distinct_per_step']:>11.1f}"
                  f"{r['step_ms']:>9.1f}")

    if "disk" in modes:
        evict_experts(layout)
        disk_bw = float(np.median([measure_disk_bandwidth(layout, direct_io=True) for _ in range(3)]))
        results["disk_bw"] = disk_bw
        rows = []
        for b in batches:
            evict_experts(layout)
            model = open_model(args.model, threads=args.threads, ctx=ctx, expert_cache=int(all_experts * args.cache_share),
                               io="direct", parallel=b, ram_budget=args.ram_budget)
            r = decode_batch(model, b, args.prompt_tokens, args.tokens, args.text)
            model.close()
            # sequences that met an end token leave their steps: the tokens a step made, not B
            r["ceiling"] = disk_bw * r["tokens_per_step"] / (r["distinct_experts_per_step"] * per_expert)
            rows.append(r)
        results["disk"] = rows
        print(f"\ndisk-bound (O_DIRECT), {args.model.name}: cold disk {disk_bw / 1e9:.2f} GB/s, expert cache "
              f"{args.cache_share:.0%} of {all_experts / 1e9:.2f} GB; ceiling = disk_bw × tokens per step / distinct expert bytes per step")
        print(f"{'B':>4}{'tok/s':>9}{'vs B=1':>8}{'ceiling':>9}{'of it':>7}{'experts/step':>14}{'MB read/step':>14}"
              f"{'hit rate':>9}{'read wait':>10}{'read GB/s':>10}{'step ms':>9}{'RSS/budget':>11}")
        for r in rows:
            print(f"{r['batch']:>4}{r['tok_per_s']:>9.2f}{r['tok_per_s'] / rows[0]['tok_per_s']:>7.2f}x"
                  f"{r['ceiling']:>9.2f}{r['tok_per_s'] / r['ceiling']:>7.0%}{r['distinct_experts_per_step']:>14.1f}"
                  f"{r['read_bytes_per_step'] / 1e6:>14.1f}{r['hit_rate']:>9.1%}{r['read_wait_share']:>10.0%}"
                  f"{(r['read_bw_while_waiting'] or 0) / 1e9:>10.2f}"
                  f"{r['step_ms']:>9.1f}{r['rss'] / r['ram_budget']:>11.0%}")
    (BENCH / "out").mkdir(exist_ok=True)
    (BENCH / "out" / "batch.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
