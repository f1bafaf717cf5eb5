"""Single-thread throughput of convert.quantize_q4k, per GGML type.

Run from the repo root: .venv/bin/python bench/quantize.py [--rows 4096] [--n 4096] [--repeats 3] [--ggml-lib SO]
Prints M weights/s per type (best of --repeats, the first compiling call excluded; IQ2_XXS, IQ2_XS
and IQ1_S, which ggml quantizes only with an importance matrix, with it in every column) and, in the
same run on the same rows, ggml's own quantizer (`ggml_quantize_chunk` of libggml-base, one
thread, called through tests/data/make_golden.py's binding) and the ratio. The library is
--ggml-lib, else the one the `llama` extra installs; without either there is no anchor and the
table says so. Writes the same numbers to bench/out/quantize.json.
"""

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

import gguf
import numpy as np

from colibri.convert.quantize_q4k import dequantize, quantize

REPO = Path(__file__).resolve().parents[1]

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1",
         "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
IMATRIX_TYPES = {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ3_XXS", "IQ3_S", "IQ2_S", "IQ1_M"}  # output depends on it
IMATRIX_ONLY = {"IQ2_XXS", "IQ2_XS", "IQ1_S"}  # ggml quantizes these only with one: their "quantize" column has it


def ggml_binding(library: Path | None):
    """tests/data/make_golden.py's `Ggml` on `library` (else llama-cpp-python's), or None when there is none."""
    spec = importlib.util.spec_from_file_location("make_golden", REPO / "tests" / "data" / "make_golden.py")
    make_golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_golden)
    if library is None:
        try:
            library = make_golden.find_library()
        except SystemExit:
            return None
    return make_golden.Ggml(library)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def best_rate(fn, weights: int, repeats: int) -> float:
    """M weights/s of the fastest of `repeats` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return weights / best / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096, help="row length (a multiple of 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "quantize.json")
    parser.add_argument("--ggml-lib", type=Path, help="libggml-base to time as the anchor (default: the llama extra's)")
    args = parser.parse_args()
    ggml = ggml_binding(args.ggml_lib)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.n), dtype=np.float32)
    imatrix = rng.random(args.n, dtype=np.float32) + np.float32(0.01)

    results = {}
    print(f"{args.rows}x{args.n} float32 weights, 1 thread, best of {args.repeats}; "
          + (f"ggml: {ggml.lib._name}, in this run" if ggml else "no ggml anchor (no libggml-base found)"))
    print("M weights/s")
    print(f"{'type':6} {'quantize':>10} {'+imatrix':>10} {'dequantize':>11}  {'ggml':>7} {'ratio':>6}")
    for qtype in TYPES:
        plain = imatrix if qtype in IMATRIX_ONLY else None  # what the "quantize" column passes
        data = quantize(x[:2], qtype, imatrix)  # compile outside the timing
        dequantize(data, qtype, args.n)
        quantize(x[:2], qtype, plain)
        row = {"quantize": best_rate(lambda: quantize(x, qtype, plain), x.size, args.repeats)}
        if qtype in IMATRIX_TYPES:
            row["quantize_imatrix"] = best_rate(lambda: quantize(x, qtype, imatrix), x.size, args.repeats)
        data = quantize(x, qtype, plain)
        row["dequantize"] = best_rate(lambda: dequantize(data, qtype, args.n), x.size, args.repeats)
        if ggml and qtype not in ("F32", "F16", "BF16"):
            ggml_type = gguf.GGMLQuantizationType[qtype]
            ggml.quantize(ggml_type, x[:2], plain)
            row["ggml"] = best_rate(lambda: ggml.quantize(ggml_type, x, plain), x.size, args.repeats)
            row["ratio"] = row["quantize"] / row["ggml"]
        results[qtype] = row
        with_imatrix = f"{row['quantize_imatrix']:10.1f}" if "quantize_imatrix" in row else f"{'-':>10}"
        target = f"{row['ggml']:7.1f} {row['ratio']:6.2f}" if "ggml" in row else f"{'-':>7} {'-':>6}"
        print(f"{qtype:6} {row['quantize']:10.1f} {with_imatrix} {row['dequantize']:11.1f}  {target}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "unit": "M weights/s, one thread, best of repeats",
        "shape": [args.rows, args.n],
        "repeats": args.repeats,
        "machine": {"cpu": cpu_name(), "python": platform.python_version()},
        "ggml": ggml.lib._name if ggml else None,
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
