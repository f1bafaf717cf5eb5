"""Benchmark: `colibri perplexity` beside `llama-perplexity` on the same GGUF and text, in one run.

The source (default: the committed reference model `models/stdlib-qwen3-moe`) is converted to
--quant by colibri and exported as a GGUF (`colibri export-gguf`, the same blocks). Then, on
the held-out text, the same --ctx and --chunks:
- each tool's perplexity, its standard error and time (llama-perplexity with --threads);
- each tool's log-probabilities saved as a KL base (`--save-base`, `--kl-divergence-base`), and
  each read by the other: colibri's `--kl-base` on llama.cpp's file, llama-perplexity's
  `--kl-divergence` on ours. The KL between the two engines is their numerical difference.
Writes bench/out/perplexity-<model>-<quant>.json.

    python bench/perplexity.py --llama-bin DIR [--source DIR] [--quant Q8_0] [--ctx 512] [--chunks 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def timed(command: list[str]) -> tuple[str, float]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr.strip()[-2000:]}")
    return done.stdout + done.stderr, time.perf_counter() - started


def colibri(*args: str) -> tuple[str, float]:
    return timed([sys.executable, "-m", "colibri.cli", *args])


def llama_figures(output: str) -> dict:
    """PPL and, from a --kl-divergence run, its statistics, as llama-perplexity prints them."""
    figures = {}
    if m := re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", output):
        figures.update(ppl=float(m.group(1)), ppl_stderr=float(m.group(2)))
    for key, label in (("ppl", r"Mean PPL\(Q\)\s*"), ("ppl_base", r"Mean PPL\(base\)\s*"), ("kld_mean", r"Mean    KLD"),
                       ("kld_max", r"Maximum KLD"), ("kld_p99", r"99\.0%   KLD"), ("kld_median", r"Median  KLD")):
        if m := re.search(label + r":\s+([-\d.]+)", output):
            figures[key] = float(m.group(1))
    if m := re.search(r"Same top p:\s+([\d.]+)", output):
        figures["same_top_p"] = float(m.group(1)) / 100
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama.cpp's llama-perplexity")
    parser.add_argument("--source", type=Path, default=MODELS / "stdlib-qwen3-moe")
    parser.add_argument("--quant", default="Q8_0")
    parser.add_argument("--text", type=Path, default=MODELS / "data" / "stdlib-heldout.txt")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "perplexity")
    args = parser.parse_args()
    work = args.work / f"{args.source.name}-{args.quant}"
    work.mkdir(parents=True, exist_ok=True)
    model, gguf = work / "colibri", work / "model.gguf"
    colibri("convert", str(args.source), str(model), "--quant", args.quant, "--force", "--no-progress")
    colibri("export-gguf", str(model), str(gguf), "--no-progress")
    llama = str(args.llama_bin / "llama-perplexity")
    shared = ["--ctx", str(args.ctx), "--chunks", str(args.chunks), "--threads", str(args.threads), "--json", "--no-progress"]
    ours_base, theirs_base = work / "colibri.logits", work / "llama.logits"
    out, ours_seconds = colibri("perplexity", str(model), "--text", str(args.text), "--save-base", str(ours_base), *shared)
    ours = json.loads(out.splitlines()[-1])
    llama_args = ["-m", str(gguf), "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads)]
    out, theirs_seconds = timed([llama, *llama_args, "-f", str(args.text)])
    theirs = llama_figures(out)
    timed([llama, *llama_args, "-f", str(args.text), "--kl-divergence-base", str(theirs_base)])
    out, _ = colibri("perplexity", str(model), "--kl-base", str(theirs_base), *shared)
    ours_on_theirs = json.loads(out.splitlines()[-1])
    out, _ = timed([llama, *llama_args, "--kl-divergence-base", str(ours_base), "--kl-divergence"])
    theirs_on_ours = llama_figures(out)

    print(f"{args.source.name} {args.quant}, {args.chunks} chunks of {args.ctx} tokens of {args.text.name}, "
          f"{args.threads} threads")
    print(f"{'':<28}{'PPL':>10}{'± stderr':>10}{'seconds':>9}")
    print(f"{'colibri perplexity':<28}{ours['ppl']:>10.4f}{ours['ppl_stderr']:>10.4f}{ours_seconds:>9.1f}")
    print(f"{'llama-perplexity':<28}{theirs['ppl']:>10.4f}{theirs['ppl_stderr']:>10.4f}{theirs_seconds:>9.1f}")
    print(f"PPL ratio colibri / llama.cpp: {ours['ppl'] / theirs['ppl']:.5f}")
    print(f"colibri against llama.cpp's base file: mean KL {ours_on_theirs['kld_mean']:.6f}, max "
          f"{ours_on_theirs['kld_max']:.5f}, same top {ours_on_theirs['same_top_p']:.2%}")
    print(f"llama.cpp against colibri's base file: mean KL {theirs_on_ours.get('kld_mean', float('nan')):.6f}, max "
          f"{theirs_on_ours.get('kld_max', float('nan')):.5f}, same top {theirs_on_ours.get('same_top_p', float('nan')):.2%}")
    (ROOT / "bench" / "out").mkdir(exist_ok=True)
    (ROOT / "bench" / "out" / f"perplexity-{args.source.name}-{args.quant}.json").write_text(json.dumps({
        "source": str(args.source), "quant": args.quant, "ctx": args.ctx, "chunks": args.chunks, "threads": args.threads,
        "colibri": {**ours, "seconds": ours_seconds}, "llama_cpp": {**theirs, "seconds": theirs_seconds, "binary": llama},
        "colibri_on_llama_base": ours_on_theirs, "llama_on_colibri_base": theirs_on_ours}, indent=1))


if __name__ == "__main__":
    main()
