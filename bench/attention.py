#!/usr/bin/env python
"""Benchmark: attention over an f16 KV cache at real models' head counts and widths, a decoded
token's and a prompt's, in ms (the best of `--repeat` calls: the kernels are compute-bound, so
the fastest call is the one the machine's noise spared).

Shapes: DeepSeek-V3's MLA as the runtime computes it (128 query heads over one latent "head":
keys 512 + 64 wide, values the latent's 512), Kimi-K2's (64 heads), the wide bench layout's
(4 heads of 256 + 64, bench/scale.py), and Qwen3-30B-A3B's GQA (32 heads over 4 of 128).

    python bench/attention.py [--positions 1024 4096] [--prompt 512] [--threads 2] [--isa avx2] [--model DIR]
    python bench/attention.py --crossover [--threads 2]

`--crossover` times a decoded token's attention at 16 to 512 positions on one thread and on
`--threads`, beside the work (multiply-adds) of each, to check where
`PARALLEL_ATTENTION_WORK` puts the change from the first to the second.

`--model DIR` (an MLA model) also times a prompt of `--prompt` tokens through the model in both
of MLA's forms: keys and values expanded from the cached latents (what long prompts take) and
the latent space (what decoded tokens take), e.g. on a few layers at DeepSeek-V3's real widths
written by `convert.synthetic` (bench/RESULTS.md, Attention).

To measure a change, run it from both trees (bench/compare.py's `importable` gives a checkout's
code to PYTHONPATH).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import numpy as np

from colibri.runtime import kernels
from colibri.runtime.kernels.emitter import TARGET_CPUS, restart_for

attention_module = importlib.import_module("colibri.runtime.kernels.attention")  # (the package's `attention` is the function)
SHAPES = {  # query heads, kv heads, key width, value width
    "deepseek-v3 mla": (128, 1, 576, 512),
    "mixtral bench gqa": (16, 4, 128, 128),
    "kimi-k2 mla": (64, 1, 576, 512),
    "wide bench mla": (4, 1, 320, 256),
    "qwen3-30b gqa": (32, 4, 128, 128),
}


def best_ms(queries: int, rows: int, shape: tuple[int, int, int, int], repeat: int) -> float:
    heads, kv_heads, width, v_width = shape
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((rows, kv_heads, width)).astype(np.float16).view(np.uint16)
    values = keys[:, :, :v_width] if kv_heads == 1 else \
        rng.standard_normal((rows, kv_heads, v_width)).astype(np.float16).view(np.uint16)
    q = rng.standard_normal((queries, heads, width)).astype(np.float32)
    kernels.attention(q, keys, values, rows - queries, 0.1)  # compile
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        kernels.attention(q, keys, values, rows - queries, 0.1)
        times.append(time.perf_counter() - started)
    return 1e3 * min(times)


def crossover(threads: int, repeat: int) -> list[dict]:
    """A decoded token's attention on one thread and on `threads` (each forced, whatever the
    work), at 16 to 512 positions of every shape, and the side `PARALLEL_ATTENTION_WORK` picks."""
    threshold, rows = attention_module.PARALLEL_ATTENTION_WORK, []
    try:
        for name, shape in SHAPES.items():
            heads, _, width, v_width = shape
            for positions in (16, 32, 64, 128, 256, 512):
                ms = {}
                for count, forced in ((1, 1 << 62), (threads, 0)):
                    kernels.set_threads(count)
                    attention_module.PARALLEL_ATTENTION_WORK = forced
                    ms[count] = best_ms(1, positions, shape, repeat)
                work = heads * positions * (width + v_width)
                rows.append({"shape": name, "positions": positions, "multiply_adds": work, "one_thread_ms": ms[1],
                             "threads_ms": ms[threads], "runs_on": threads if work >= threshold else 1})
    finally:
        attention_module.PARALLEL_ATTENTION_WORK = threshold
        kernels.set_threads(threads)
    return rows


def mla_prompt_seconds(model_dir: str, tokens: int, threads: int) -> dict:
    """The best of 3 prefills of `tokens` tokens with MLA's prompt rows expanded, and in the latent space."""
    from colibri.runtime import model as model_module
    from colibri.runtime import open_model

    m = open_model(model_dir, threads=threads, ctx=tokens + 1, ram_budget="16G")
    ids = np.random.default_rng(0).integers(0, m.config.vocab_size, tokens).tolist()
    seconds = {}
    for form, queries in (("expanded", model_module.EXPANDED_MLA_QUERIES), ("latent", 1 << 62)):
        model_module.EXPANDED_MLA_QUERIES = queries
        m.reset()
        m.prefill(ids[:queries if queries < tokens else 8])  # compile this form's kernels
        times = []
        for _ in range(3):
            m.reset()
            started = time.perf_counter()
            m.prefill(ids, all_logits=False)
            times.append(time.perf_counter() - started)
        seconds[form] = min(times)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 4096], help="cached positions a decoded token sees")
    parser.add_argument("--prompt", type=int, default=512, help="queries of the prompt rows (from position 0)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--isa", choices=("native", *TARGET_CPUS), default="native",
                        help="compile the kernels for this target (avx2: this CPU without AVX-512, AMX or AVX-VNNI)")
    parser.add_argument("--model", help="an MLA model: also time a --prompt-token prompt through it in both forms")
    parser.add_argument("--crossover", action="store_true",
                        help="a decoded token's attention on one thread and on --threads, at 16 to 512 positions")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    restart_for(args.isa)
    kernels.set_threads(args.threads)
    if args.crossover:
        print_crossover(crossover(args.threads, args.repeat), args.threads, args.json)
        return
    rows = []
    for name, shape in SHAPES.items():
        for positions in args.positions:
            rows.append({"shape": name, "queries": 1, "positions": positions, "ms": best_ms(1, positions, shape, args.repeat)})
        rows.append({"shape": name, "queries": args.prompt, "positions": args.prompt,
                     "ms": best_ms(args.prompt, args.prompt, shape, max(args.repeat // 2, 1))})
    prompt = mla_prompt_seconds(args.model, args.prompt, args.threads) if args.model else None
    if args.json:
        print(json.dumps({"kernels": kernels.kernel_paths(), "threads": args.threads, "rows": rows,
                          "mla_prompt_seconds": prompt}, indent=1))
        return
    print(f"kernels: {kernels.kernel_paths()}; {args.threads} threads; best of {args.repeat} calls")
    print(f"{'shape':<18}{'queries':>8}{'positions':>10}{'ms':>10}")
    for row in rows:
        print(f"{row['shape']:<18}{row['queries']:>8}{row['positions']:>10}{row['ms']:>10.2f}")
    if prompt:
        print(f"{args.model}: a {args.prompt}-token prompt in {prompt['expanded']:.2f} s with MLA's keys and values "
              f"expanded, {prompt['latent']:.2f} s in the latent space")


def print_crossover(rows: list[dict], threads: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"kernels": kernels.kernel_paths(), "threads": threads,
                          "parallel_attention_work": attention_module.PARALLEL_ATTENTION_WORK, "rows": rows}, indent=1))
        return
    print(f"kernels: {kernels.kernel_paths()}; a decoded token's attention, best of the calls; "
          f"PARALLEL_ATTENTION_WORK = {attention_module.PARALLEL_ATTENTION_WORK} multiply-adds")
    print(f"{'shape':<20}{'positions':>10}{'mult-adds':>12}{'1 thread ms':>12}{f'{threads} threads ms':>13}"
          f"{'ratio':>7}{'runs on':>9}")
    for row in rows:
        print(f"{row['shape']:<20}{row['positions']:>10}{row['multiply_adds']:>12}{row['one_thread_ms']:>12.4f}"
              f"{row['threads_ms']:>13.4f}{row['one_thread_ms'] / row['threads_ms']:>7.2f}{row['runs_on']:>9}")


if __name__ == "__main__":
    main()
