"""Routing traces replayed through the expert cache: every policy's hit rate at a cache size,
and Belady's MIN (evict the expert whose next use is farthest away: the offline bound no
online policy can beat). A trace is `colibri run --trace-routing FILE`'s JSON lines (position,
layer, experts); `bench/policy.py` and `colibri report` read it.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

from colibri.runtime.expert_store import CacheIndex


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
