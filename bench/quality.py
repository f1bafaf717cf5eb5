"""Benchmark: which quant to pick, measured on a model trained on real text.

For each recipe, with and without an importance matrix, and for `colibri-convert --target-size`
(and `--target-size --kl-base`, its tables scored on the calibration text) at the weight-file
bytes of a few of them: the converted size, bits per weight,
routed-expert bytes a token reads, and against the BF16 conversion on held-out text
(`colibri perplexity --kl-base`, llama-perplexity's method): perplexity, the ratio to the
base's, mean / 99th-percentile / largest KL divergence and how often the top token agrees.

SOURCE defaults to the committed reference model `models/stdlib-qwen3-moe`; TEXT to its
held-out text, CALIBRATION (the importance matrix's text, `colibri imatrix`) to a slice of
its training text. Prints a table and writes bench/out/quality-<model>.json (or --json-out).

    python bench/quality.py [--source DIR] [--work DIR] [--chunks 64] [--recipes Q2_K,...] [--imatrix-recipes Q2_K,...]
                           [--sized-like IQ2_XXS,...] [--ranked-like IQ2_XXS,...] [--kl-tables N] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
RECIPES = "Q2_K,Q3_K_S,Q3_K_M,Q4_0,Q4_K_S,Q4_K_M,IQ4_NL,IQ4_XS,MXFP4_MOE,Q5_K_M,Q6_K,Q8_0,TQ2_0,IQ3_S,IQ3_M"
# the grid mixes but IQ3_S and IQ3_M need one (llama-quantize refuses them without)
IMATRIX_RECIPES = "Q2_K,Q3_K_M,Q4_K_M,IQ4_XS,IQ1_S,IQ1_M,IQ2_XXS,IQ2_XS,IQ2_S,IQ2_M,IQ3_XXS,IQ3_XS,IQ3_S,IQ3_M"
SIZED_LIKE = "IQ2_XXS,Q2_K,Q3_K_M"  # --target-size at these fixed mixes' sizes (the imatrix rows where there are)
CALIBRATION_CHUNKS = 16  # chunks of the calibration text --kl-base scores a table on


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
    files = sum(f["size"] for name, f in layout.manifest["files"].items() if name == "resident.bin" or name.startswith("experts/"))
    return {"mb": (resident + experts) / 1e6, "bits_per_weight": 8 * (resident + experts) / weights,
            "expert_kb_per_token": per_token / 1e3, "file_bytes": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=MODELS / "stdlib-qwen3-moe", help="the checkpoint (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "quality", help="a folder for the conversions")
    parser.add_argument("--text", type=Path, default=MODELS / "data" / "stdlib-heldout.txt", help="held-out text scored")
    parser.add_argument("--calibration", type=Path, default=MODELS / "data" / "stdlib-calibration.txt",
                        help="the importance matrix's text (default: a slice of the training text)")
    parser.add_argument("--chunks", type=int, default=64, help="chunks of 512 tokens scored (default: %(default)s)")
    parser.add_argument("--recipes", default=RECIPES, help="recipes without an imatrix (default: %(default)s)")
    parser.add_argument("--imatrix-recipes", default=IMATRIX_RECIPES, help="recipes with one (default: %(default)s)")
    parser.add_argument("--sized-like", default=SIZED_LIKE,
                        help="recipes run above whose weight-file bytes a --target-size conversion is given, with the "
                             "same importance matrix or none (default: %(default)s)")
    parser.add_argument("--ranked-like", default="",
                        help="recipes above whose weight-file bytes a --target-size --kl-base conversion is given, its "
                             "tables scored on the calibration text's first %d chunks (default: none)" % CALIBRATION_CHUNKS)
    parser.add_argument("--kl-tables", type=int, default=None,
                        help="the ranked conversions' --kl-tables: tables scored at most (default: colibri-convert's)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="where the rows go (default: bench/out/quality-<source folder name>.json)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base, logits, imatrix = args.work / "BF16", args.work / "base.logits", args.work / "imatrix.gguf"
    colibri("convert", str(args.source), str(base), "--quant", "BF16", "--force", "--no-progress")
    scored = ["--chunks", str(args.chunks), "--json", "--no-progress"]
    started = time.perf_counter()
    base_result = json.loads(colibri("perplexity", str(base), "--text", str(args.text), "--save-base", str(logits), *scored))
    print(f"BF16 base: PPL {base_result['ppl']:.4f} ± {base_result['ppl_stderr']:.4f} over {base_result['tokens']} "
          f"tokens ({time.perf_counter() - started:.0f} s)", flush=True)
    colibri("imatrix", str(base), "--text", str(args.calibration), "-o", str(imatrix), "--chunks", "64", "--no-progress")
    calibration_logits = args.work / "calibration.logits"
    if args.ranked_like:
        colibri("perplexity", str(base), "--text", str(args.calibration), "--chunks", str(CALIBRATION_CHUNKS),
                "--save-base", str(calibration_logits), "--no-progress")
    runs = [(r, False) for r in args.recipes.split(",") if r] + [(r, True) for r in args.imatrix_recipes.split(",") if r]
    rows = [{"recipe": "BF16", "imatrix": False, **model_numbers(base), "ppl": base_result["ppl"],
             "ppl_stderr": base_result["ppl_stderr"], "ppl_ratio": 1.0, "kld_mean": 0.0, "kld_p99": 0.0, "kld_max": 0.0,
             "same_top_p": 1.0}]
    print(f"{'recipe':<14} {'imatrix':<8} {'MB':>6} {'bits/w':>7} {'KB/token':>9} {'PPL':>8} {'ratio':>7} "
          f"{'mean KL':>9} {'KL p99':>8} {'KL max':>8} {'top-1':>7}")
    runs += [(f"sized={r}", None) for r in args.sized_like.split(",") if r]
    runs += [(f"ranked={r}", None) for r in args.ranked_like.split(",") if r]
    for recipe, with_imatrix in runs:
        if with_imatrix is None:  # --target-size at the bytes of the fixed mix's row
            kind, _, mix = recipe.partition("=")
            like = next(row for row in reversed(rows) if row["recipe"] == mix)
            with_imatrix, how = like["imatrix"], ["--target-size", str(like["file_bytes"])]
            if kind == "ranked":
                how += ["--kl-base", str(calibration_logits), "--json",
                        *(["--kl-tables", str(args.kl_tables)] if args.kl_tables else [])]
        else:
            how = ["--quant", recipe]
        out = args.work / f"{recipe}{'-imatrix' if with_imatrix else ''}"
        converted = colibri("convert", str(args.source), str(out), *how, "--force", "--no-progress",
                            *(["--imatrix", str(imatrix)] if with_imatrix else []))
        tables = len(json.loads(converted)["ranking"]) if "--kl-base" in how else None
        r = json.loads(colibri("perplexity", str(out), "--kl-base", str(logits), *scored))
        rows.append({"recipe": recipe, "imatrix": with_imatrix, "tables_scored": tables, **model_numbers(out),
                     **{k: r[k] for k in ("ppl", "ppl_stderr", "ppl_ratio", "kld_mean", "kld_p99", "kld_max", "same_top_p")}})
        shutil.rmtree(out)
        r = rows[-1]
        print(f"{recipe:<14} {'yes' if with_imatrix else 'no':<8} {r['mb']:>6.2f} {r['bits_per_weight']:>7.2f} "
              f"{r['expert_kb_per_token']:>9.1f} {r['ppl']:>8.3f} {r['ppl_ratio']:>7.4f} {r['kld_mean']:>9.5f} "
              f"{r['kld_p99']:>8.4f} {r['kld_max']:>8.3f} {r['same_top_p']:>7.1%}"
              + (f"  ({tables} tables scored)" if tables else ""), flush=True)
    json_out = args.json_out or ROOT / "bench" / "out" / f"quality-{args.source.name}.json"
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(
        {"source": str(args.source), "text": str(args.text), "chunks": args.chunks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
