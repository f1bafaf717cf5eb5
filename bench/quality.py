"""Benchmark: which quant to pick. For each recipe, with and without an importance matrix: the
converted size, bits per weight, expert bytes read per token, decode tok/s and the KL
divergence from the BF16 conversion (`colibri smoke --compare`).

The BF16 conversion of SOURCE is the baseline (`colibri smoke --record`) and the base of the
importance matrix (`colibri imatrix`, on --text or on a built-in pseudo-text). Each recipe's
conversion is measured and deleted (the bench model is several GB a conversion). Prints a
table and writes bench/out/quality.json.

    python bench/quality.py --source DIR --work DIR [--recipes Q2_K,Q4_K_M,...] [--imatrix-recipes Q2_K,...]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = "Q2_K,Q3_K_M,Q4_0,Q4_K_S,Q4_K_M,IQ4_NL,IQ4_XS,MXFP4_MOE,Q5_K_M,Q6_K,Q8_0,TQ2_0"
IMATRIX_RECIPES = "Q2_K,Q3_K_M,Q4_K_M,IQ4_XS"
WORDS = ("the river town woke slowly and the mill turned while bread cooled on the sill; bells rang over old "
         "roads at dawn, carts came in from the hills, and by night the lamps were lit along the water").split()


def colibri(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "colibri.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"colibri {' '.join(args)} failed:\n{done.stderr.strip()}")
    return done.stdout


def model_numbers(path: Path) -> dict:
    """Size, bits per weight and routed-expert bytes a token reads, from the manifest."""
    from colibri.formats.layout import ModelLayout

    layout = ModelLayout(path)
    c = layout.config
    resident = sum(t.nbytes for t in layout.tensors.values())
    experts = sum(t.count * t.expert_bytes for t in layout.expert_layers.values())
    weights = sum(math.prod(t.shape) for t in layout.tensors.values()) + sum(
        t.count * sum(math.prod(m.shape) for m in t.matrices.values()) for t in layout.expert_layers.values())
    per_token = sum(c.n_experts_used * t.expert_bytes for t in layout.expert_layers.values())
    return {"gb": (resident + experts) / 1e9, "bits_per_weight": 8 * (resident + experts) / weights,
            "expert_mb_per_token": per_token / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="the checkpoint (bench/model.py writes one)")
    parser.add_argument("--work", type=Path, required=True, help="a folder for the conversions (one at a time)")
    parser.add_argument("--recipes", default=RECIPES, help="recipes without an imatrix (default: %(default)s)")
    parser.add_argument("--imatrix-recipes", default=IMATRIX_RECIPES, help="recipes with one (default: %(default)s)")
    parser.add_argument("--text", type=Path, help="calibration text for the imatrix (default: a built-in pseudo-text)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per smoke prompt")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base, baseline = args.work / "BF16", args.work / "baseline.json"
    colibri("convert", str(args.source), str(base), "--quant", "BF16", "--workers", str(args.workers))
    colibri("smoke", str(base), "--record", str(baseline), "--max-tokens", str(args.max_tokens))
    text = args.text or args.work / "calibration.txt"
    if args.text is None:
        random.seed(0)
        text.write_text(" ".join(random.choice(WORDS) for _ in range(20000)))
    imatrix = args.work / "imatrix.gguf"
    started = time.perf_counter()
    colibri("imatrix", str(base), "--text", str(text), "-o", str(imatrix), "--chunk", "256", "--chunks", "8", "--no-progress")
    print(f"imatrix: 8 chunks of 256 tokens in {time.perf_counter() - started:.0f} s", flush=True)
    runs = [(r, False) for r in args.recipes.split(",") if r] + [(r, True) for r in args.imatrix_recipes.split(",") if r]
    rows = [{"recipe": "BF16", "imatrix": False, **model_numbers(base), "mean_kl": 0.0, "same_top1": 1.0,
             "decode_tok_s": json.loads(baseline.read_text())["generation_tok_per_s"]}]
    print(f"{'recipe':<10} {'imatrix':<8} {'GB':>6} {'bits/w':>7} {'MB/token':>9} {'tok/s':>7} {'mean KL':>9} {'top-1':>7}")
    for recipe, with_imatrix in runs:
        out = args.work / f"{recipe}{'-imatrix' if with_imatrix else ''}"
        colibri("convert", str(args.source), str(out), "--quant", recipe, "--workers", str(args.workers),
                *(["--imatrix", str(imatrix)] if with_imatrix else []))
        report = json.loads(colibri("smoke", str(out), "--compare", str(baseline), "--json"))
        rows.append({"recipe": recipe, "imatrix": with_imatrix, **model_numbers(out), "mean_kl": report["mean_kl"],
                     "same_top1": report["same_top1"], "decode_tok_s": report["generation_tok_per_s"]})
        shutil.rmtree(out)
        r = rows[-1]
        print(f"{recipe:<10} {'yes' if with_imatrix else 'no':<8} {r['gb']:>6.2f} {r['bits_per_weight']:>7.2f} "
              f"{r['expert_mb_per_token']:>9.1f} {r['decode_tok_s']:>7.2f} {r['mean_kl']:>9.5f} {r['same_top1']:>7.1%}",
              flush=True)
    out_dir = ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quality.json").write_text(json.dumps({"source": str(args.source), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
