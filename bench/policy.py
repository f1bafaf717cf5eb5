"""Benchmark: expert-cache hit rates of each policy on routing traces, next to Belady's optimum.

Replays `colibri run --trace-routing FILE` output (JSON lines: position, layer, experts)
through the runtime's own `CacheIndex` with every policy at several cache sizes (in
experts), and through Belady's MIN (evict the expert whose next use is farthest away: the
offline upper bound no online policy can beat). Prints a table, writes bench/out/policy.json.

    python bench/policy.py TRACE.jsonl [TRACE2.jsonl ...] [--sizes 0.05 0.1 0.25 0.5]
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from pathlib import Path

from colibri.runtime.expert_store import POLICIES, CacheIndex

BENCH = Path(__file__).resolve().parent


def read_trace(path: Path) -> list[list[tuple[int, int]]]:
    """One request (the experts one token needs in one layer) per trace line, in order."""
    requests = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        requests.append([(record["layer"], e) for e in record["experts"]])
    return requests


def replay(requests, capacity: int, policy: str) -> float:
    index = CacheIndex(capacity, policy)
    for request in requests:
        index.place(request)
    return index.hits / max(index.hits + index.misses, 1)


def belady(requests, capacity: int) -> float:
    """Hit rate of Belady's MIN, with the runtime's rule that a request's own experts stay."""
    flat = [key for request in requests for key in sorted(set(request))]
    next_use, last_seen = [0.0] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = last_seen.get(flat[i], float("inf"))
        last_seen[flat[i]] = i
    cached: dict = {}  # key → its next use
    heap: list = []  # (-next use, key); stale entries are skipped when popped
    hits = position = 0
    for request in requests:
        keys = sorted(set(request))
        for key in keys:
            upcoming, position = next_use[position], position + 1
            if key in cached:
                hits += 1
            elif not capacity:
                continue
            elif len(cached) >= capacity and not _evict_farthest(cached, heap, set(keys)):
                continue  # every cached expert is needed by this very request
            cached[key] = upcoming
            heapq.heappush(heap, (-upcoming, key))
    return hits / max(len(flat), 1)


def _evict_farthest(cached: dict, heap: list, protected: set) -> bool:
    kept = []
    evicted = False
    while heap:
        far, victim = heapq.heappop(heap)
        if cached.get(victim) != -far:
            continue  # stale
        if victim in protected:
            kept.append((far, victim))
            continue
        del cached[victim]
        evicted = True
        break
    for entry in kept:
        heapq.heappush(heap, entry)
    return evicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5],
                        help="cache sizes as shares of all distinct experts in the trace")
    args = parser.parse_args()
    results = []
    print(f"{'trace':<28}{'cache':>7}" + "".join(f"{p:>9}" for p in POLICIES) + f"{'Belady':>9}")
    for path in args.traces:
        requests = read_trace(path)
        distinct = len({key for request in requests for key in request})
        for share in args.sizes:
            capacity = max(1, int(distinct * share))
            row = {"trace": path.name, "cache_share": share, "cache_experts": capacity,
                   **{p: replay(requests, capacity, p) for p in POLICIES}, "belady": belady(requests, capacity)}
            results.append(row)
            print(f"{path.name:<28}{share:>6.0%} " + "".join(f"{row[p]:>9.1%}" for p in POLICIES) + f"{row['belady']:>9.1%}")
    (BENCH / "out").mkdir(exist_ok=True)
    (BENCH / "out" / "policy.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
