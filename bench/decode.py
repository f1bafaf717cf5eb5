"""Benchmark: prompt and decode tok/s on the reference model, in RAM and streaming, for each
way of reading experts (`--io pread,direct,mmap`, side by side in one run).

For each I/O mode:
(a) in RAM, warm: every expert fits the expert cache; the ceiling is
    memory_bw / bytes_touched_per_token;
(b) cache a share of the experts (--stream-share), page cache warm (one run first): what
    pread's page cache adds beside its expert cache, and what mmap's budget keeps out;
(c) the same cache, disk-bound: expert files dropped from the page cache first
    (POSIX_FADV_DONTNEED, no root needed); the ceiling is
    disk_bw / (expert_bytes_per_token × (1 − hit_rate)), with disk_bw measured cold.
(a) and (c) also run batched (`--batch` sequences decoding together, aggregate tok/s).
`--prefetch` turns the next layer's read-ahead on in every row. Buffered misses after the
first touch may be served by the page cache, as on a real machine (O_DIRECT always reads the
disk); the effective read bandwidth is reported next to the cold disk bandwidth, with prefetch
accuracy and the share of read time hidden behind compute. Every row must produce the same tokens.
Decode feeds seeded random token ids, as llama-bench does (a greedy loop on a random model
revisits the same few experts and flatters the cache), or with --text a text's tokens (for a
trained model's real routing); the tokens compared across modes are each step's argmax. Prints a table against the ceilings and llama.cpp: `--llama-bench BIN --gguf
FILE` runs llama-bench in the same run with the same prompt and decode lengths (-p, -n), its decode
after as many tokens as ours (-d: each decoded token attends to as many positions); without
it there is no anchor and the llama.cpp columns say so. `--llama-repack 0` runs it on the file's
row layout rather than the rows ggml interleaves in RAM at load (its default, 1). `--isa avx2` compiles the kernels for an
AVX2-only CPU, to compare with a llama.cpp built so; `--isa auto` for the target `colibri run` would choose. `--busy N` runs everything, llama-bench
included, beside N processes that each keep a core busy at the same priority. Writes
bench/out/decode.json.

    python bench/decode.py [--model DIR] [--prompt-tokens 64] [--tokens 48] [--stream-share 0.25]
        [--io pread,direct,mmap] [--batch 8] [--repeat 3] [--prefetch] [--isa avx2] [--llama-bench BIN --gguf FILE]
        [--llama-repack 0|1] [--text FILE] [--busy N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from colibri.formats.layout import ModelLayout
from colibri.runtime import open_model
from colibri.runtime.expert_store import cache_bytes_for_all
from colibri.runtime.isa_choice import choose
from colibri.runtime.kernels import kernel_paths
from colibri.runtime.kernels.emitter import TARGET_CPUS, restart_for
from colibri.runtime.plan import measure_disk_bandwidth

from machine import busy_processes, evict_experts, read_bandwidth  # bench/machine.py: a script's own folder is first on sys.path

BENCH = Path(__file__).resolve().parent


def llama_bench(binary: Path, gguf: Path, threads: int, prompt_tokens: int, tokens: int, repack: int = 1) -> dict:
    """llama.cpp's prompt and decode tok/s (mean of 3) on `gguf` at our lengths, from `llama-bench -o json`:
    the prompt from an empty cache, the decode after `prompt_tokens` (`-d`), as ours decodes after its prompt
    (from an empty cache, llama-bench's default, each token attends to fewer positions than ours).
    `repack` 1 (llama-bench's default) lets ggml interleave the rows of the types it repacks (Q4_K and
    IQ4_NL with AVX2, Q2_K with AVX-512, Q4_0, Q8_0) in RAM at load, 0 keeps the file's layout."""
    def speed(prompt: int, gen: int, depth: int) -> float:
        done = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
                               "-d", str(depth), "-r", "3", "--repack", str(repack), "-o", "json"],
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout)[0]["avg_ts"]

    return {"prompt": speed(prompt_tokens, 0, 0), "decode": speed(0, tokens, prompt_tokens), "depth": prompt_tokens,
            "prompt_tokens": prompt_tokens, "tokens": tokens, "binary": str(binary), "repack": repack}


def reference_model(out: Path) -> Path:
    """The Mixtral reference shape at Q4_K_M, built (bench/model.py + colibri-convert) if absent."""
    if (out / "colibri.json").is_file():
        return out
    source = BENCH / "out" / "mixtral-ref"
    subprocess.run([sys.executable, str(BENCH / "model.py"), str(source), "--shape", "mixtral-ref"], check=True)
    subprocess.run([sys.executable, "-m", "colibri.cli", "convert", str(source), str(out), "--quant", "Q4_K_M"], check=True)
    return out


def fed_ids(model, count: int, text: Path | None) -> list[int]:
    """The ids a run feeds: seeded random ids, or the first `count` tokens of `text` (a trained
    model's real routing, for its hit rates and prefetch accuracy)."""
    if text is not None:
        ids = model.tokenizer.encode(text.read_text(encoding="utf-8"))[:count]
        if len(ids) < count:
            raise SystemExit(f"{text}: fewer than {count} tokens")
        return ids
    high = min(30000, model.config.vocab_size)  # the same ids as ever on the reference model, any vocabulary's
    return [int(t) for t in np.random.default_rng(0).integers(min(100, high // 2), high, count)]


def run(model, prompt_tokens: int, tokens: int, text: Path | None = None) -> dict:
    """One prompt, then `tokens` decode steps fed the ids after it (`fed_ids`); `tokens` holds each step's argmax."""
    ids = fed_ids(model, prompt_tokens + tokens, text)
    model.reset()
    started = time.perf_counter()
    logits = model.prefill(ids[:prompt_tokens], all_logits=False)[-1]
    prefill_seconds = time.perf_counter() - started
    read_before = model.store.bytes_read
    predicted = []
    started = time.perf_counter()
    for token in ids[prompt_tokens:]:
        predicted.append(int(np.argmax(logits)))
        logits = model.decode(token)
    seconds = time.perf_counter() - started
    stats = model.stats()
    return {"prompt_tok_per_s": prompt_tokens / prefill_seconds, "decode_tok_per_s": tokens / seconds,
            "hit_rate": stats["expert_hit_rate"], "read_bytes_per_token": (model.store.bytes_read - read_before) / tokens,
            "effective_read_bw": (model.store.bytes_read - read_before) / seconds,
            "prefetch_accuracy": stats["prefetch_accuracy"], "read_hidden_share": stats["read_hidden_share"],
            "threads": stats["threads"], "tokens": predicted}


def median_run(model, prompt_tokens: int, tokens: int, repeat: int, text: Path | None) -> dict:
    """`run` `repeat` times: the last run's figures with the median prompt and decode speeds."""
    runs = [run(model, prompt_tokens, tokens, text) for _ in range(repeat)]
    return {**runs[-1], **{key: statistics.median(r[key] for r in runs) for key in ("prompt_tok_per_s", "decode_tok_per_s")}}


def optional(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BENCH / "out" / "mixtral-ref-q4km")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=lambda t: t if t == "auto" else int(t), default=os.cpu_count(),
                        help="compute threads, or auto (the runtime's --threads auto; llama-bench gets every core)")
    parser.add_argument("--stream-share", type=float, default=0.25, help="expert cache as a share of all experts when streaming")
    parser.add_argument("--isa", choices=("native", "auto", *TARGET_CPUS), default="native",
                        help="compile the kernels for this target: avx2 = this CPU without AVX-512, AMX or AVX-VNNI "
                             "(an AMD Zen 2/3); avx2-vnni keeps AVX-VNNI (Intel Alder Lake); auto = the one colibri "
                             "run --isa auto chooses for --model by timing (its timings are printed)")
    parser.add_argument("--llama-bench", type=Path, metavar="BIN",
                        help="llama.cpp's llama-bench (built for the same target) to run on --gguf in this run")
    parser.add_argument("--gguf", type=Path, help="the same model as a GGUF, for --llama-bench")
    parser.add_argument("--llama-repack", type=int, choices=(0, 1), default=1,
                        help="llama-bench's --repack: 1 (its default) interleaves the rows of the types ggml repacks "
                             "in RAM at load, 0 multiplies the file's layout as ours do (default: %(default)s)")
    parser.add_argument("--io", default="pread,direct,mmap",
                        help="expert I/O modes to run side by side, comma-separated (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences of the batched rows (0: none; default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs of each warm row, whose median prompt and decode speeds are shown; "
                             "a cold row runs once (default: %(default)s)")
    parser.add_argument("--prefetch", action="store_true", help="read ahead the next layer's predicted experts in every row")
    parser.add_argument("--text", type=Path, help="feed this text's tokens instead of random ids (a trained model's real "
                                                  "routing: its hit rates and prefetch accuracy)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run beside N processes that each keep a core busy at this priority (default: none)")
    args = parser.parse_args()
    if args.isa == "auto":
        choice = choose(reference_model(args.model), os.cpu_count() if args.threads == "auto" else args.threads)
        print(f"--isa auto: {choice.target} ({'cached' if choice.cached else 'timed now'}; products a token: "
              f"{choice.timings(2)})")
        args.isa = choice.target
    restart_for(args.isa)  # before the busy processes start: it replaces this process
    if args.llama_bench and not args.gguf:
        parser.error("--llama-bench needs --gguf, the same model as a GGUF")
    with busy_processes(args.busy):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Every row, and llama-bench's anchor; prints the table and writes bench/out/decode.json."""
    cores = os.cpu_count() if args.threads == "auto" else args.threads
    llama = llama_bench(args.llama_bench, args.gguf, cores, args.prompt_tokens, args.tokens,
                        args.llama_repack) if args.llama_bench else None

    layout = ModelLayout(reference_model(args.model))
    c = layout.config
    resident = sum(t.nbytes for t in layout.tensors.values())
    all_experts = cache_bytes_for_all(layout)
    expert_per_token = sum(t.expert_bytes * c.n_experts_used for t in layout.expert_layers.values())
    mem_bw = read_bandwidth(cores)

    from batch import decode_batch  # (bench/batch.py imports this module's helpers)

    disk_bw = measure_disk_bandwidth(layout)
    share = int(all_experts * args.stream_share)
    results, batched = {}, {}
    for io in args.io.split(","):
        for regime, cache, cold in (("in RAM", all_experts, False), (f"cache {args.stream_share:.0%}", share, False),
                                    (f"cache {args.stream_share:.0%}, disk", share, True)):
            evict_experts(layout)
            model = open_model(layout.directory, threads=args.threads, ctx=max(1024, args.prompt_tokens + args.tokens + 8), expert_cache=cache, io=io,
                               prefetch=args.prefetch)
            if not cold:
                run(model, args.prompt_tokens, args.tokens, args.text)  # warm: kernels compiled, experts and page cache filled
            r = results[f"{io}: {regime}"] = median_run(model, args.prompt_tokens, args.tokens,
                                                        1 if cold else args.repeat, args.text)
            r["ceiling"] = mem_bw / (resident + expert_per_token) if cache == all_experts \
                else disk_bw / max(expert_per_token * (1 - r["hit_rate"]), 1)
            r["read_ceiling"] = None if cache == all_experts else disk_bw / max(r["read_bytes_per_token"], 1)
            model.close()
            if args.batch and regime != f"cache {args.stream_share:.0%}":
                evict_experts(layout)
                model = open_model(layout.directory, threads=args.threads, ctx=max(1024, args.prompt_tokens + args.tokens + 8), expert_cache=cache, io=io,
                                   prefetch=args.prefetch, parallel=args.batch)
                if not cold:
                    decode_batch(model, args.batch, args.prompt_tokens, 8, args.text)
                batched[f"{io}: {regime}"] = decode_batch(model, args.batch, args.prompt_tokens, args.tokens, args.text)
                model.close()
    first = next(iter(results.values()))
    same = all(r["tokens"] == first["tokens"] for r in results.values())

    print(f"\ndecode on {layout.directory.name}: resident {resident / 1e9:.2f} GB, experts {all_experts / 1e9:.2f} GB, "
          f"{expert_per_token / 1e6:.0f} MB of experts per token; read bw {mem_bw / 1e9:.1f} GB/s, cold disk {disk_bw / 1e9:.2f} GB/s; "
          f"streaming cache {args.stream_share:.0%} of the experts"
          + (f"; beside {args.busy} busy process{'es' if args.busy > 1 else ''}" if args.busy else ""))
    print("ceiling: memory_bw / bytes per token in RAM, disk_bw / (expert bytes per token × (1 − hit rate)) streaming;"
          " read ceiling: disk_bw / bytes actually read per token (wrong guesses included)")
    print(f"{'mode':<24}{'prompt tok/s':>13}{'decode tok/s':>13}{'vs llama tg':>12}{'hit rate':>9}{'MB read/tok':>12}"
          f"{'ceiling':>9}{'of it':>7}{'read ceil.':>11}{'of it':>7}{'eff. read GB/s':>15}{'prefetch acc.':>14}{'read hidden':>12}")
    for name, r in results.items():
        speed, read_ceiling = r["decode_tok_per_s"], r["read_ceiling"]
        cells = [f"{r['prompt_tok_per_s']:>13.1f}", f"{speed:>13.2f}",
                 f"{optional(llama and speed / llama['decode'], '.2f') + ('x' if llama else ''):>12}",
                 f"{r['hit_rate']:>9.1%}", f"{r['read_bytes_per_token'] / 1e6:>12.1f}", f"{r['ceiling']:>9.1f}",
                 f"{speed / r['ceiling']:>7.0%}", f"{optional(read_ceiling, '.1f'):>11}",
                 f"{optional(read_ceiling and speed / read_ceiling, '.0%'):>7}", f"{r['effective_read_bw'] / 1e9:>15.2f}",
                 f"{optional(r['prefetch_accuracy'], '.0%'):>14}", f"{optional(r['read_hidden_share'], '.0%'):>12}"]
        print(f"{name:<24}" + "".join(cells))
    anchor = (f"llama.cpp {llama['binary']} (--repack {llama['repack']}) in this run: prompt {args.prompt_tokens} {llama['prompt']:.1f}, "
              f"decode {args.tokens} at depth {llama['depth']} {llama['decode']:.1f} tok/s" if llama else "no llama.cpp anchor (--llama-bench not given)")
    print(f"kernels compiled for: {args.isa}: {kernel_paths()}; {anchor}")
    print(f"threads ({args.threads}): " + ", ".join(f"{name} {r['threads']}" for name, r in results.items()))
    if batched:
        print(f"\nbatched, {args.batch} sequences decoding together: aggregate tok/s (ms a step, hit rate, MB read a step)")
        for name, b in batched.items():
            print(f"{name:<24}{b['tok_per_s']:>13.1f}{b['step_ms']:>10.1f} ms{b['hit_rate']:>9.1%}"
                  f"{b['read_bytes_per_step'] / 1e6:>10.1f} MB")
    print(f"same tokens in every mode: {'yes' if same else 'NO'}"
          + (f"; prompt tok/s vs llama.cpp's, {args.prompt_tokens} tokens each: "
             f"{first['prompt_tok_per_s'] / llama['prompt']:.2f}x" if llama else ""))
    (BENCH / "out").mkdir(exist_ok=True)
    (BENCH / "out" / "decode.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "threads": args.threads, "memory_read_bw": mem_bw, "disk_bw": disk_bw,
        "stream_share": args.stream_share, "same_tokens": same, "modes": results, "batched": batched, "llama_cpp": llama,
        "isa": args.isa, "kernels": kernel_paths(), "busy_processes": args.busy}, indent=1))


if __name__ == "__main__":
    main()
