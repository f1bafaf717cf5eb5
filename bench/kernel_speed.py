"""Benchmark: GB/s of weight bytes through the runtime kernels, against memory bandwidth.

Measures the machine's memory bandwidth (a numpy copy, read + written bytes; a numpy sum; and
a numba read-only reduction with 1 and with all threads, the ceiling a streaming kernel can
reach), then `matvec` for each encoding with 1 and all threads, int8 (the fast path's int8
activations) and exact (float32) paths, and `matmul` with n=64 on those and, where the CPU has
AMX, on the tiles (bfloat16), on matrices larger than the last-level cache. Last, the int8 row
dot's own speed, in ns per weight block: one thread, its rows in L2, many passes per timing,
the best of --repeat (what memory and a shared machine's noise do not blur).
Beside each int8 matvec and matmul, ggml's own (`bench/ggml_matvec.py`: llama.cpp's mul_mat of
the same bytes and activations, the same threads) and our ratio to it.
Prints a table with each result as a fraction of the read bandwidth at the same thread count
(what bounds a matvec) and in multiply-adds per second (what bounds a matmul), and writes
bench/out/kernels.json. Every number is the median of --repeat runs.

    python bench/kernel_speed.py [--mb 1024] [--repeat 7] [--encodings Q4_K Q6_K Q8_0 BF16] [--isa avx2]
                                 [--ggml-lib DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

from colibri.convert.quantize_q4k import IMATRIX_NEEDED, quantize

ROOT = Path(__file__).resolve().parent.parent
from colibri.formats.encodings import block_size, row_bytes  # noqa: E402
from colibri.runtime import amx, kernels  # noqa: E402
from colibri.runtime.kernels.emitter import TARGET_CPUS, restart_for  # noqa: E402
from colibri.runtime.kernels.rows import rows_times  # noqa: E402

COLS = 4096
MATMUL_N = 64
IN_CACHE_ROWS = 64  # rows of the in-cache timing: 64 x COLS weights stay in a core's L2
IN_CACHE_PASSES = 500  # passes over them per timing


def median_seconds(run, repeat: int) -> float:
    run()  # compile, and fault the pages in
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(nbytes: int, repeat: int, thread_counts) -> dict:
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    result = {
        "copy_gbs": 2 * a.nbytes / median_seconds(lambda: np.copyto(b, a), repeat) / 1e9,
        "numpy_sum_gbs": a.nbytes / median_seconds(lambda: a.sum(), repeat) / 1e9,
    }
    del b
    words = a.view(np.uint64)
    for n in thread_counts:
        kernels.set_threads(n)
        result[f"read_{n}t_gbs"] = a.nbytes / median_seconds(lambda: kernels.read_seconds(words, n), repeat) / 1e9
    return result


def weight_bytes(encoding: str, rows: int, cols: int) -> np.ndarray:
    """rows x cols weights in `encoding`: 256 random rows quantized by the project's
    quantizer, tiled (real block contents, no denormals, quick to make)."""
    sample = np.random.default_rng(0).standard_normal((256, cols)).astype(np.float32)
    imatrix = np.ones(cols, np.float32) if encoding in IMATRIX_NEEDED else None
    tile = quantize(sample, encoding, imatrix).reshape(-1)
    return np.resize(tile, rows * row_bytes(encoding, cols))


@numba.njit(nogil=True)
def _passes(tag, w, rows, row_nbytes, cols, act, out, count):
    for _ in range(count):
        rows_times(tag, w, 0, rows, row_nbytes, cols, act, out)


def in_cache_ns_per_block(encoding: str, repeat: int) -> float:
    """ns per weight block of the int8 row dot with one activation (a token's decoded alone), on
    one thread, its rows in L2: the best of `repeat` timings (other processes only ever add time)."""
    matrix = kernels.Matrix(weight_bytes(encoding, IN_CACHE_ROWS, COLS), encoding, IN_CACHE_ROWS, COLS)
    with kernels.decoding_alone():  # a decoded token's row dot
        act = matrix.activation(np.random.default_rng(1).standard_normal((1, COLS)).astype(np.float32), tiles=False)
    out = np.empty((1, IN_CACHE_ROWS), np.float32)
    run = [matrix.tag, matrix.data, IN_CACHE_ROWS, matrix.row_nbytes, matrix.cols, act, out]
    _passes(*run, 1)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        _passes(*run, IN_CACHE_PASSES)
        best = min(best, time.perf_counter() - start)
    return best / IN_CACHE_PASSES / (IN_CACHE_ROWS * COLS // block_size(encoding)[0]) * 1e9


def ggml_anchor(folder: Path | None):
    """ggml's own matvec (bench/ggml_matvec.py) from `folder`, or the llama extra's; None without either."""
    from ggml_matvec import GgmlMatvec, default_library_folder

    try:
        folder = folder or default_library_folder()
    except ImportError:
        print("no ggml anchor: the llama extra is not installed and --ggml-lib was not given", file=sys.stderr)
        return None
    print(f"ggml anchor: {folder}")
    return GgmlMatvec(folder)


def timed_anchor(ggml, matrix, encoding: str, w: np.ndarray, rows: int, x: np.ndarray, threads: int, repeat: int):
    """ggml's seconds for the same product on the same bytes, once its product of the first 64
    rows is checked against ours (both round the activations to 8 bits, so within 2% of the
    largest)."""
    few = 64 * row_bytes(encoding, COLS)
    theirs = ggml.product(encoding, w[:few], 64, COLS, x)
    ours = kernels.Matrix(w[:few], encoding, 64, COLS)(x)
    if np.abs(theirs - ours).max() > 0.02 * np.abs(ours).max():
        raise SystemExit(f"ggml's {encoding} product differs from ours: the anchor would time something else")
    return ggml.seconds(encoding, w, rows, COLS, x, threads, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="matvec matrix size (default 1024; above the L3 size)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--encodings", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "BF16"])
    parser.add_argument("--isa", choices=("native", *TARGET_CPUS), default="native",
                        help="compile the kernels for this target (avx2: no AVX-512, AMX or AVX-VNNI)")
    parser.add_argument("--ggml-lib", type=Path, default=None,
                        help="folder with libggml-base.so and libggml-cpu.so whose matvec is timed beside ours on the "
                             "same bytes (default: the llama extra's, when installed; build llama.cpp for --isa's "
                             "target to compare like with like)")
    args = parser.parse_args()
    restart_for(args.isa)
    print(f"kernels compiled for {args.isa}: {kernels.kernel_paths()}")

    if os.getloadavg()[0] > 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.2f}: other processes share the cores and the memory "
              "bus, the numbers below will be low and noisy", file=sys.stderr)
    all_threads = numba.config.NUMBA_NUM_THREADS
    thread_counts = sorted({1, all_threads})
    bandwidth = memory_bandwidth(args.mb << 20, args.repeat, thread_counts)
    print(f"memory: copy {bandwidth['copy_gbs']:.1f} GB/s (read + write), numpy sum "
          f"{bandwidth['numpy_sum_gbs']:.1f} GB/s, read " +
          ", ".join(f"{bandwidth[f'read_{n}t_gbs']:.1f} GB/s ({n} thread{'s' * (n > 1)})" for n in thread_counts))

    ggml = ggml_anchor(args.ggml_lib)
    results = []
    print(f"\n{'op':<10}{'encoding':<9}{'path':<7}{'threads':>8}{'GB/s':>8}{'of read bw':>12}{'GMAC/s':>9}"
          f"{'ggml GB/s':>11}{'ratio':>7}")
    for encoding in args.encodings:
        quantized = encoding in kernels.FAST_ENCODINGS
        for op, mb in (("matvec", args.mb), (f"matmul{MATMUL_N}", max(16, args.mb // 16))):
            paths = ("int8", "exact") if quantized else ("exact",)
            if quantized and op != "matvec" and amx.available():
                paths = ("int8", "tiles", "exact")
            rows = (mb << 20) // row_bytes(encoding, COLS)
            w = weight_bytes(encoding, rows, COLS)
            x = np.random.default_rng(1).standard_normal((MATMUL_N if op != "matvec" else 1, COLS)).astype(np.float32)
            for path in paths:
                matrix = kernels.Matrix(w, encoding, rows, COLS, exact=path == "exact")
                for n in thread_counts:
                    kernels.set_threads(n)

                    def run():
                        matrix.times(matrix.activation(x, tiles=path == "tiles"), x.shape[0])
                    # a matvec is a decoded token's product: its activation a token's decoded alone
                    with kernels.decoding_alone() if op == "matvec" else contextlib.nullcontext():
                        seconds = median_seconds(run, args.repeat if op == "matvec" else max(3, args.repeat // 2))
                    gbs = w.nbytes / seconds / 1e9
                    fraction = gbs / bandwidth[f"read_{n}t_gbs"]
                    gmacs = rows * COLS * x.shape[0] / seconds / 1e9  # multiply-adds: what bounds a matmul
                    anchor = timed_anchor(ggml, matrix, encoding, w, rows, x, n, args.repeat) \
                        if ggml is not None and path == paths[0] else None
                    ggml_gbs = w.nbytes / anchor / 1e9 if anchor else None
                    results.append({"op": op, "encoding": encoding, "path": path, "threads": n, "rows": rows,
                                    "cols": COLS, "matrix_mb": w.nbytes / 2**20, "seconds": seconds,
                                    "gbs": gbs, "fraction_of_read_bw": fraction, "gmac_per_s": gmacs,
                                    "ggml_gbs": ggml_gbs})
                    print(f"{op:<10}{encoding:<9}{path:<7}{n:>8}{gbs:>8.2f}{fraction:>11.0%}{gmacs:>9.1f}"
                          + (f"{ggml_gbs:>11.2f}{gbs / ggml_gbs:>6.2f}x" if ggml_gbs else ""), flush=True)
            del w

    in_cache = []
    print(f"\nint8 row dot, one thread, rows in L2, best of {args.repeat}:")
    for encoding in args.encodings:
        if encoding in kernels.FAST_ENCODINGS:
            ns = in_cache_ns_per_block(encoding, args.repeat)
            gbs = block_size(encoding)[1] / ns
            in_cache.append({"encoding": encoding, "ns_per_block": ns, "gbs": gbs})
            print(f"  {encoding:<9}{ns:6.2f} ns a block ({gbs:.1f} GB/s)", flush=True)

    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "numba": numba.__version__, "threading_layer": numba.threading_layer(),
                    "load_average": os.getloadavg()},
        "isa": args.isa, "kernels": kernels.kernel_paths(),
        "memory_bandwidth": bandwidth,
        "results": results,
        "in_cache": in_cache,
    }
    path = ROOT / "bench" / "out" / "kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nthreading layer: {numba.threading_layer()}; wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
