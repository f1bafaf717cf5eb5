"""Routing traces replayed through the expert cache: every policy's hit rate at a cache size,
and Belady's MIN (evict the expert whose next use is farthest away: the offline bound no
online policy can beat). A trace is `colibri run --trace-routing FILE`'s JSON lines (step,
row, position, layer, experts); `bench/policy.py` and `colibri report` read it.

A forward step logs each MoE layer once for all its rows (a batch's sequences, a prompt
chunk's tokens), and fetches the union of their experts once: the replay asks for that union,
layer by layer, as the runtime does (`step_requests`).
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

from colibri.runtime.expert_store import POLICIES, CacheIndex

SHARES = (0.05, 0.1, 0.25, 0.5)  # cache sizes of a policy table, as shares of the trace's distinct experts


def steps_of(records: list[dict]) -> list[list[list[list[tuple[int, int]]]]]:
    """The trace's records grouped as the runtime ran them: steps, each a list of rows (one
    token each), each row its layers' (layer, expert) keys in order. A record's `step` and
    `row` say where it belongs; in a trace without them, a step starts where the layer goes
    down and a record's row is its place among the step's records of that layer."""
    steps, previous, row = [], None, 0
    for r in records:
        if r.get("step") is not None:
            new_step, row = not steps or r["step"] != previous["step"], r["row"]
        else:
            new_step = previous is None or r["layer"] < previous["layer"]
            row = 0 if new_step or r["layer"] != previous["layer"] else row + 1
        if new_step:
            steps.append([])
        rows = steps[-1]
        rows.extend([] for _ in range(row + 1 - len(rows)))
        rows[row].append([(r["layer"], e) for e in r["experts"]])
        previous = r
    return steps


def step_requests(step: list[list[list[tuple[int, int]]]]) -> list[list[tuple[int, int]]]:
    """A step's cache requests: per layer, in order, the union of its rows' experts, in file
    order (`ExpertStore.fetch` reads a step's distinct experts of a layer once)."""
    layers: dict[int, set] = {}
    for row in step:
        for request in row:
            for key in request:
                layers.setdefault(key[0], set()).add(key)
    return [sorted(keys) for keys in layers.values()]


def read_trace(path: Path) -> list[list[tuple[int, int]]]:
    """A trace file's cache requests, step by step (`step_requests`)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [request for step in steps_of(records) for request in step_requests(step)]


def policy_table(requests, shares=SHARES) -> list[dict]:
    """Each policy's hit rate and Belady's at each share of the trace's distinct experts. A
    cache holds at least the largest request (as the runtime's holds a token's experts): below
    that, a request's own experts could not all stay, and Belady's MIN would not be the best."""
    distinct = len({key for request in requests for key in request})
    least = max((len(set(request)) for request in requests), default=1)
    rows = []
    for share in shares:
        capacity = max(least, int(distinct * share))
        rows.append({"cache_share": share, "cache_experts": capacity,
                     **{p: replay(requests, capacity, p) for p in POLICIES}, "belady": belady(requests, capacity)})
    return rows


def replay(requests, capacity: int, policy: str) -> float:
    index = CacheIndex(capacity, policy)
    for request in requests:
        index.place(request)
    return index.hits / max(index.hits + index.misses, 1)


def belady(requests, capacity: int) -> float:
    """Hit rate of Belady's MIN, with the runtime's rule that a request's own experts stay: the
    best any eviction order gets when `capacity` holds the largest request (tests/test_report.py
    checks it against an exhaustive search)."""
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
