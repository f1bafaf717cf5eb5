"""Benchmark: in-RAM prompt and decode tok/s of two or more checkouts, interleaved.

On a shared machine the speed of the same code moves by 20-40% within an hour, so a change is
measured against its parent in alternation: each round runs every checkout once (a fresh
process, warm-up pass, then `--passes` timed passes over the same prompt), and the table
gives each checkout's medians and their ratio to the first, and whether the greedy tokens
agree with the first's (they need not when a change alters the arithmetic on purpose). The
passes are this tree's `bench/decode.py` `run`, so a checkout needs the runtime API it uses.

    git worktree add /tmp/before HEAD~3
    python bench/compare.py /tmp/before . [--model DIR] [--prompt-tokens 512] [--rounds 3] [--isa avx2]

`--isa avx2` compiles every checkout's kernels for an AVX2-only CPU (as bench/decode.py's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from colibri.runtime.kernels.emitter import TARGET_CPUS, target_environment
from decode import reference_model  # bench/decode.py: a script's own folder is first on sys.path

# Runs on a checkout's code (`importable`), timing with this tree's
# bench/decode.py `run`, and prints one JSON line.
MEASURE = """
import importlib.util, json, os, sys
import colibri.runtime
assert colibri.runtime.__file__.startswith(os.getcwd()), colibri.runtime.__file__  # this checkout's code
from colibri.formats.layout import ModelLayout
from colibri.runtime import open_model
from colibri.runtime.expert_store import cache_bytes_for_all
decode_bench, model, prompt_tokens, tokens, passes, threads = *sys.argv[1:3], *map(int, sys.argv[3:7])
spec = importlib.util.spec_from_file_location("decode_bench", decode_bench)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
m = open_model(model, threads=threads, ctx=prompt_tokens + tokens + 1,
               expert_cache=cache_bytes_for_all(ModelLayout(model)))
bench.run(m, prompt_tokens, tokens)  # compile, and read every expert the passes use
runs = [bench.run(m, prompt_tokens, tokens) for _ in range(passes)]
print(json.dumps({"prompt": [r["prompt_tok_per_s"] for r in runs], "decode": [r["decode_tok_per_s"] for r in runs],
                  "tokens": runs[0]["tokens"]}))
"""


def importable(checkout: Path) -> Path:
    """A folder from which `import colibri...` gives `checkout`'s code: its packages linked as
    pyproject.toml's package-dir lays them out (the installed editable package points at the
    working tree, and a checkout's own root has no `colibri/runtime`). One folder per
    checkout, kept, so that numba's cache, keyed by source path, serves the next process."""
    where = Path(tempfile.gettempdir()) / "colibri-compare" / hashlib.sha256(str(checkout).encode()).hexdigest()[:16]
    shutil.rmtree(where, ignore_errors=True)
    layout = tomllib.loads((checkout / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(layout.items()):
        link = where.joinpath(*package.split("."))
        if package == "colibri":
            link.mkdir(parents=True)
            for item in (checkout / folder).iterdir():
                (link / item.name).symlink_to(item)
        else:
            link.symlink_to(checkout / folder)
    return where


def measure(checkout: Path, args) -> dict:
    root = importable(checkout)
    # the checkout's code first, then this tree's bench/ (decode.py's own imports: machine, kernel_speed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT / "bench")]))
    if args.isa != "native":
        env.update(target_environment(args.isa))
    command = [sys.executable, "-c", MEASURE, str(ROOT / "bench" / "decode.py"), str(args.model),
               str(args.prompt_tokens), str(args.tokens), str(args.passes), str(args.threads)]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{checkout}: the measurement failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs="+", type=Path, help="source trees to compare; the first is the baseline")
    parser.add_argument("--model", type=Path, default=ROOT / "bench" / "out" / "mixtral-ref-q4km")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=48, help="decoded tokens per pass")
    parser.add_argument("--passes", type=int, default=2, help="timed passes per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per checkout, interleaved")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--isa", choices=("native", *TARGET_CPUS), default="native",
                        help="the CPU the kernels are compiled for (default: this one)")
    args = parser.parse_args()
    args.model = reference_model(args.model)

    args.checkouts = [checkout.resolve() for checkout in args.checkouts]  # importable() links to them from elsewhere
    results = {checkout: {"prompt": [], "decode": [], "tokens": None} for checkout in args.checkouts}
    for round_ in range(args.rounds):
        for checkout in args.checkouts:
            run = measure(checkout.resolve(), args)
            r = results[checkout]
            r["prompt"] += run["prompt"]
            r["decode"] += run["decode"]
            r["tokens"] = r["tokens"] or run["tokens"]
            print(f"round {round_ + 1}: {checkout}: prompt {', '.join(f'{v:.1f}' for v in run['prompt'])}, "
                  f"decode {', '.join(f'{v:.1f}' for v in run['decode'])} tok/s", flush=True)

    base = results[args.checkouts[0]]
    print(f"\n{args.prompt_tokens}-token prompt, {args.tokens} decoded, in RAM, {args.threads} threads, kernels for "
          f"{args.isa}; medians of {args.rounds} x {args.passes} passes")
    print(f"{'checkout':<40}{'prompt tok/s':>14}{'ratio':>8}{'decode tok/s':>14}{'ratio':>8}  same tokens")
    for checkout, r in results.items():
        prompt, decode = statistics.median(r["prompt"]), statistics.median(r["decode"])
        print(f"{str(checkout):<40}{prompt:>14.1f}{prompt / statistics.median(base['prompt']):>7.2f}x"
              f"{decode:>14.1f}{decode / statistics.median(base['decode']):>7.2f}x  {r['tokens'] == base['tokens']}")
    out = ROOT / "bench" / "out" / "compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
