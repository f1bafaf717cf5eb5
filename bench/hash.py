#!/usr/bin/env python
"""Benchmark: sha256 of a multi-GB checkpoint, page cache warm, parallel against one thread.

    python bench/hash.py [--source DIR] [--shards N] [--jobs N] [--repeat 5] [--quiet-wait 120]

Hashes every shard with `verify.sha_check.hash_files` (the hasher of `colibri verify-source`)
and with plain `hashlib.sha256` on one thread reading 8 MB chunks. The ratio is parallel speed
/ (single-thread speed × min(cores, shards)); target ≥ 0.9. Since one shard is hashed by one
thread, the shard sizes cap it: `bound` is the ratio of a perfect largest-first schedule.
On a shared machine other processes steal cores: each timed run first waits (up to
--quiet-wait s) for an idle second, the best run of each kind is kept, and the cores other
processes used during it are reported (`others_cores`; ~0 for a clean measurement).
Source: /tmp/colibri-bench-mixtral if present (7 GB, 4 shards), else the bf16 Mixtral reference
checkpoint written by bench/model.py. Writes bench/out/hash.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

from colibri.verify.sha_check import CHUNK_BYTES, hash_files

BENCH = pathlib.Path(__file__).resolve().parent

DEFAULT_SOURCE = pathlib.Path("/tmp/colibri-bench-mixtral")


def single_thread(paths: list[pathlib.Path]) -> list[str]:
    """hashlib.sha256 of each file, one after the other, 8 MB reads."""
    digests, buffer = [], bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    for path in paths:
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
        digests.append(digest.hexdigest())
    return digests


def in_memory_gb_per_s() -> float:
    data = os.urandom(1 << 20) * 256
    started = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / 1e9 / (time.perf_counter() - started)


def schedule_bound(sizes: list[int], threads: int) -> float:
    """Best ratio when whole files go, largest first, to the least loaded of `threads` equal threads."""
    loads = [0] * threads
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return sum(sizes) / (threads * max(loads))


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes have used, CPU seconds this one has used)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    ours = os.times()
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), ours.user + ours.system


def wait_quiet(cores: int, limit: float) -> None:
    """Return after a second in which the machine was idle, or after `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = busy_seconds()[0]
        time.sleep(1)
        if busy_seconds()[0] - before < 0.05 * cores:
            return


def timed(fn, *args, quiet_wait: float, cores: int) -> dict:
    """Seconds of one run of `fn(*args)`, and the cores other processes kept busy meanwhile."""
    wait_quiet(cores, quiet_wait)
    (all_before, ours_before), started = busy_seconds(), time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - started
    all_after, ours_after = busy_seconds()
    others = max(0.0, (all_after - all_before) - (ours_after - ours_before)) / seconds
    return {"seconds": seconds, "others_cores": round(others, 2), "result": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=pathlib.Path, default=DEFAULT_SOURCE if DEFAULT_SOURCE.is_dir() else BENCH / "out" / "mixtral-ref")
    parser.add_argument("--shards", type=int, help="hash only the first N shards (default: all)")
    parser.add_argument("--jobs", type=int, help="threads (default: min(cores, shards), as colibri verify-source)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each; the fastest is reported")
    parser.add_argument("--quiet-wait", type=float, default=120, help="seconds to wait for an idle machine before each run")
    args = parser.parse_args()

    if not any(args.source.glob("*.safetensors")):
        subprocess.run([sys.executable, str(BENCH / "model.py"), str(args.source), "--shape", "mixtral-ref"], check=True)
    paths = sorted(args.source.glob("*.safetensors"))[: args.shards]
    sizes = [p.stat().st_size for p in paths]
    total, cores = sum(sizes), os.cpu_count() or 1
    threads = args.jobs or min(cores, len(paths))

    reference = single_thread(paths)  # also warms the page cache
    single, parallel = [], []
    for _ in range(args.repeat):  # interleaved, so that both see the same conditions
        single.append(timed(single_thread, paths, quiet_wait=args.quiet_wait, cores=cores))
        parallel.append(timed(hash_files, paths, threads, False, quiet_wait=args.quiet_wait, cores=cores))
        assert parallel[-1].pop("result") == single[-1].pop("result") == reference, "digests differ"
    best_single, best_parallel = (min(runs, key=lambda r: r["seconds"]) for runs in (single, parallel))
    single_gbps = total / 1e9 / best_single["seconds"]
    parallel_gbps = total / 1e9 / best_parallel["seconds"]
    ideal = single_gbps * min(cores, len(paths))
    result = {
        "benchmark": "hash", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {cores} cores",
        "source": str(args.source), "shards": len(paths), "gb": total / 1e9, "threads": threads, "repeat": args.repeat,
        "in_memory_gb_per_s": in_memory_gb_per_s(), "single_thread_gb_per_s": single_gbps,
        "parallel_gb_per_s": parallel_gbps, "ratio": parallel_gbps / ideal,
        "bound": schedule_bound(sizes, min(cores, len(paths))), "runs_single": single, "runs_parallel": parallel,
        "median_ratio": statistics.median(s["seconds"] for s in single) / statistics.median(p["seconds"] for p in parallel) / min(cores, len(paths)),
    }
    result["ratio_of_bound"] = result["ratio"] / result["bound"]
    print(f"sha256 of {len(paths)} shards, {total / 1e9:.2f} GB, page cache warm, best of {args.repeat} ({cores} cores)")
    print(f"  hashlib in memory      {result['in_memory_gb_per_s']:.2f} GB/s")
    print(f"  single thread, 8 MB    {single_gbps:.2f} GB/s   (other processes: {best_single['others_cores']} cores)")
    print(f"  parallel, {threads} threads    {parallel_gbps:.2f} GB/s   (other processes: {best_parallel['others_cores']} cores)")
    print(f"  ratio                  {result['ratio']:.3f} of single × {min(cores, len(paths))} (target ≥ 0.9); "
          f"the shard sizes allow at most {result['bound']:.3f} ({result['ratio_of_bound']:.3f} of that); "
          f"median runs: {result['median_ratio']:.3f}")
    (BENCH / "out").mkdir(exist_ok=True)
    name = "hash.json" if args.shards is None else f"hash-{len(paths)}-shards.json"
    (BENCH / "out" / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
