"""Benchmark: colibri-convert on the synthetic bf16 Mixtral reference checkpoint (7.0 GB).

Prints source MB/s, M weights/s per worker, and peak RSS (the whole process tree, sampled
from /proc, and the largest single process). `--llama-quantize BIN` runs llama.cpp's
llama-quantize in the same run on the same weights (the source converted to BF16 and
exported as a GGUF, untimed), page cache evicted the same way, with as many threads as the
most workers, and prints each row against it; without it there is no anchor and the table
says so. Writes bench/out/convert.json.

    python bench/convert.py [--source DIR] [--workers 1 2] [--quant Q4_K_M] [--repeat 1] [--llama-quantize BIN]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import evict  # bench/machine.py: a script's own folder is first on sys.path

BENCH = Path(__file__).resolve().parent


def tree_rss_kb(root: int) -> tuple[int, int]:
    """(sum, max) of VmRSS over `root` and all its descendants, in kB."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/status") as f:
                kb = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = kb
    total, largest, stack = 0, 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        largest = max(largest, rss.get(pid, 0))
        stack.extend(children.get(pid, []))
    return total, largest


def timed(command: list[str]) -> tuple[float, int, int, str]:
    """(seconds, peak RSS of the process tree in kB, of its largest process, stdout) of `command`."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_total = peak_single = 0
    while process.poll() is None:
        total, single = tree_rss_kb(process.pid)
        peak_total, peak_single = max(peak_total, total), max(peak_single, single)
        time.sleep(0.2)
    stdout, stderr = process.communicate()
    if process.returncode:
        raise SystemExit(f"{command[0]} failed:\n{stderr}")
    return time.monotonic() - started, peak_total, peak_single, stdout


def run_once(source: Path, out: Path, quant: str, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    for path in source.rglob("*.safetensors"):
        evict(path)
    seconds, peak_total, peak_single, stdout = timed(
        [sys.executable, "-m", "colibri.cli", "convert", str(source), str(out), "--quant", quant,
         "--workers", str(workers), "--json"])
    summary = json.loads(stdout)
    return {
        "seconds": seconds,
        "source_mb_per_s": summary["source_bytes"] / 1e6 / seconds,
        "m_weights_per_s_per_worker": summary["parameters"] / 1e6 / seconds / workers,
        "peak_rss_tree_mb": peak_total / 1024,
        "peak_rss_process_mb": peak_single / 1024,
        "output_gb": summary["output_bytes"] / 1e9,
        "expert_bpw": summary["expert_bpw"],
        "resident_bpw": summary["resident_bpw"],
    }


def llama_quantize(binary: Path, source: Path, work: Path, quant: str, threads: int, source_bytes: int) -> dict:
    """llama-quantize's time, source MB/s and peak RSS on `source` as a BF16 GGUF (made untimed)."""
    bf16, gguf_in, gguf_out = work / "bf16", work / "bf16.gguf", work / f"{quant}.gguf"
    work.mkdir(parents=True, exist_ok=True)
    if not gguf_in.is_file():
        subprocess.run([sys.executable, "-m", "colibri.cli", "convert", str(source), str(bf16), "--quant", "BF16",
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-m", "colibri.cli", "export-gguf", str(bf16), str(gguf_in), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(bf16)
    evict(gguf_in)
    seconds, peak_total, _, _ = timed([str(binary), str(gguf_in), str(gguf_out), quant, str(threads)])
    gguf_out.unlink()
    return {"binary": str(binary), "threads": threads, "seconds": seconds,
            "mb_per_s": source_bytes / 1e6 / seconds, "peak_rss_mb": peak_total / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=BENCH / "out" / "mixtral-ref", help="bf16 reference checkpoint (written if absent)")
    parser.add_argument("--out", type=Path, default=BENCH / "out" / "mixtral-ref-q4km")
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting; the median is reported")
    parser.add_argument("--llama-quantize", type=Path, metavar="BIN",
                        help="llama.cpp's llama-quantize, run in this run as the anchor (default: no anchor)")
    args = parser.parse_args()

    subprocess.run([sys.executable, str(BENCH / "model.py"), str(args.source), "--shape", "mixtral-ref"], check=True)
    source_bytes = sum(p.stat().st_size for p in args.source.glob("*.safetensors"))
    source_gb = source_bytes / 1e9
    rows = []
    for workers in args.workers:
        runs = [run_once(args.source, args.out, args.quant, workers) for _ in range(args.repeat)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"workers": workers, **median})

    anchor = None
    if args.llama_quantize:
        anchor = llama_quantize(args.llama_quantize, args.source, BENCH / "out" / "convert-anchor", args.quant,
                                max(args.workers), source_bytes)
    print(f"\ncolibri-convert {args.quant} of {source_gb:.2f} GB bf16 (Mixtral reference shape), page cache evicted, "
          f"median of {args.repeat}; " + (f"llama-quantize in this run: {anchor['seconds']:.0f} s, {anchor['mb_per_s']:.0f} MB/s, "
                                          f"{anchor['peak_rss_mb']:.0f} MB with {anchor['threads']} threads"
                                          if anchor else "no llama-quantize anchor (--llama-quantize not given)"))
    print(f"{'workers':>7} {'seconds':>8} {'MB/s':>7} {'vs llama':>8} {'Mw/s/core':>9} {'RSS tree MB':>11} {'RSS proc MB':>11} {'out GB':>7}")
    for r in rows:
        versus = f"{r['source_mb_per_s'] / anchor['mb_per_s']:>7.2f}x" if anchor else f"{'-':>8}"
        print(f"{r['workers']:>7} {r['seconds']:>8.1f} {r['source_mb_per_s']:>7.1f} {versus} "
              f"{r['m_weights_per_s_per_worker']:>9.2f} {r['peak_rss_tree_mb']:>11.0f} {r['peak_rss_process_mb']:>11.0f} {r['output_gb']:>7.3f}")
    result = {
        "benchmark": "convert", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cores",
        "quant": args.quant, "source_gb": source_gb, "repeat": args.repeat, "rows": rows, "llama_quantize": anchor,
    }
    (BENCH / "out").mkdir(exist_ok=True)
    (BENCH / "out" / "convert.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
