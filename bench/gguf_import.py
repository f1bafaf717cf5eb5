"""Benchmark: colibri-convert MODEL.gguf OUT (GGUF import) against the disk's read speed.

Exports a multi-GB colibri model to GGUF once (`colibri export-gguf`, timed), then for each
`--workers` setting: evicts the GGUF from the page cache (posix_fadvise DONTNEED), imports
it in a subprocess and measures wall time and peak RSS (`getrusage(RUSAGE_CHILDREN)`: the
largest single process, workers included). Two anchors, both on the same evicted file: its
cold sequential read bandwidth (16 MiB reads), and a cold copy of it next to the output
(read + write + fsync, what any re-layout must at least do, since the import writes as many
bytes as it reads). Writes bench/out/gguf_import.json.

    python bench/gguf_import.py [--model DIR] [--workers 1 2] [--repeat 1]

DIR defaults to /tmp/bench-q4km (a 2.1 GB Q4_K_M Mixtral-shaped model) when it exists, else
bench/out/mixtral-ref-q4km; build one with `python bench/model.py DIR --shape mixtral-ref`
and `colibri-convert DIR OUT`, or simply `python bench/convert.py`, which does both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import evict  # bench/machine.py: a script's own folder is first on sys.path

BENCH = Path(__file__).resolve().parent
DEFAULT_MODEL = Path("/tmp/bench-q4km") if Path("/tmp/bench-q4km/colibri.json").exists() else BENCH / "out" / "mixtral-ref-q4km"
READ_BYTES = 16 << 20


def cold_read_gb_per_s(path: Path) -> float:
    evict(path)
    buffer = bytearray(READ_BYTES)
    started = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return path.stat().st_size / 1e9 / (time.monotonic() - started)


def cold_copy_gb_per_s(path: Path, target: Path) -> float:
    evict(path)
    started = time.monotonic()
    shutil.copyfile(path, target)
    fd = os.open(target, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.monotonic() - started
    target.unlink()
    return path.stat().st_size / 1e9 / seconds


def colibri(*args: str) -> dict:
    """Run a colibri command with --json in a subprocess: its summary, wall time, and the peak RSS
    of the largest process this interpreter has waited for so far."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "colibri.cli", *args, "--json", "--no-progress"], capture_output=True, text=True)
    seconds = time.monotonic() - started
    if result.returncode:
        raise SystemExit(f"colibri {args[0]} failed:\n{result.stderr}")
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"summary": json.loads(result.stdout), "seconds": seconds, "peak_rss_mb": peak_mb}


def import_once(gguf: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    evict(gguf)
    run = colibri("convert", str(gguf), str(out), "--workers", str(workers))
    return {"seconds": run["seconds"], "import_seconds": run["summary"]["seconds"],
            "gb_per_s": gguf.stat().st_size / 1e9 / run["seconds"], "peak_rss_mb": run["peak_rss_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="colibri model to export and import back (default: %(default)s)")
    parser.add_argument("--gguf", type=Path, default=BENCH / "out" / "bench-model.gguf", help="where the GGUF goes (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=BENCH / "out" / "gguf-import", help="import target (default: %(default)s)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting; the median is reported")
    args = parser.parse_args()
    if not (args.model / "colibri.json").exists():
        raise SystemExit(f"{args.model}: no colibri model; see the docstring for how to build one")

    args.gguf.parent.mkdir(parents=True, exist_ok=True)
    export = colibri("export-gguf", str(args.model), str(args.gguf))
    gguf_bytes = args.gguf.stat().st_size
    disk = statistics.median(cold_read_gb_per_s(args.gguf) for _ in range(max(args.repeat, 2)))
    copy = statistics.median(cold_copy_gb_per_s(args.gguf, args.out.with_name("copy.gguf")) for _ in range(max(args.repeat, 2)))
    # RSS of imports only: the export above would count in RUSAGE_CHILDREN's maximum, so each import
    # runs in a fresh interpreter that reports its own children
    rows = []
    for workers in args.workers:
        runs = [json.loads(subprocess.run(
            [sys.executable, __file__, "--measure", str(args.gguf), str(args.out), str(workers)],
            check=True, capture_output=True, text=True).stdout) for _ in range(args.repeat)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"workers": workers, **row, "of_read": row["gb_per_s"] / disk, "of_copy": row["gb_per_s"] / copy})
    shutil.rmtree(args.out, ignore_errors=True)

    print(f"\nimport of a {gguf_bytes / 1e9:.2f} GB {export['summary']['file_type']} GGUF "
          f"({export['summary']['architecture']}, from {args.model}), page cache evicted, median of {args.repeat}")
    print(f"export-gguf: {export['seconds']:.1f} s ({gguf_bytes / 1e9 / export['seconds']:.2f} GB/s); "
          f"cold sequential read of the GGUF: {disk:.2f} GB/s; cold copy (read + write + fsync): {copy:.2f} GB/s")
    print("seconds: the whole command; of which import: after Python's start-up (header parse, plan, copy, manifest)")
    print(f"{'workers':>7} {'seconds':>8} {'import':>7} {'GB/s':>6} {'of read':>8} {'of copy':>8} {'peak RSS MB':>12}")
    for r in rows:
        print(f"{r['workers']:>7} {r['seconds']:>8.1f} {r['import_seconds']:>7.1f} {r['gb_per_s']:>6.2f} {r['of_read']:>7.0%} "
              f"{r['of_copy']:>7.0%} {r['peak_rss_mb']:>12.0f}")
    result = {
        "benchmark": "gguf_import", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cores",
        "model": str(args.model), "gguf_gb": gguf_bytes / 1e9, "export_seconds": export["seconds"],
        "disk_read_gb_per_s": disk, "disk_copy_gb_per_s": copy, "repeat": args.repeat, "rows": rows,
    }
    (BENCH / "out" / "gguf_import.json").write_text(json.dumps(result, indent=1))


def measure(gguf: str, out: str, workers: str) -> None:
    print(json.dumps(import_once(Path(gguf), Path(out), int(workers))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        measure(*sys.argv[2:])
    else:
        main()
