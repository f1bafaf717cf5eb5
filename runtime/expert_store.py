"""ExpertStore: the one way the runtime reaches routed experts.

It owns a byte-budgeted cache of whole expert records (one slab of equal slots, so a
cached expert costs no allocation), the miss path (one `pread` of the expert's
contiguous record straight into its slot), and the statistics the user sees. Which
expert to evict is decided by a small pluggable policy object. Placement never changes
the bytes: an expert read from the cache, the page cache or the disk is the same record.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from formats.layout import ModelLayout

Key = tuple[int, int]  # (layer, expert)


class LRUPolicy:
    """Least recently used: evict the expert untouched for longest."""

    name = "lru"

    def __init__(self):
        self.order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def forget(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self, protected: set[Key]) -> Key | None:
        return next((k for k in self.order if k not in protected), None)


class FrequencyRecencyPolicy:
    """Frequency with exponential ageing: each use adds 1 to a score that halves every
    `half_life` requests; evict the lowest score. Hot experts survive a burst of cold
    ones (which plain LRU lets flush the cache), yet old popularity fades."""

    name = "lfru"

    def __init__(self, half_life: float = 2048.0):
        self.decay = 0.5 ** (1.0 / half_life)
        self.clock = 0
        self.score: dict[Key, tuple[float, int]] = {}  # key → (score at last use, time of last use)

    def _current(self, key: Key) -> float:
        score, last = self.score[key]
        return score * self.decay ** (self.clock - last)

    def touch(self, key: Key) -> None:
        self.clock += 1
        self.score[key] = ((self._current(key) if key in self.score else 0.0) + 1.0, self.clock)

    def forget(self, key: Key) -> None:
        self.score.pop(key, None)

    def victim(self, protected: set[Key]) -> Key | None:
        candidates = (k for k in self.score if k not in protected)
        return min(candidates, key=self._current, default=None)


POLICIES = {"lru": LRUPolicy, "lfru": FrequencyRecencyPolicy}


class CacheIndex:
    """Which expert sits in which cache slot, decided by a policy; counts hits and misses.

    Separate from the I/O so that `bench/policy.py` can replay routing traces through the
    very same bookkeeping the runtime uses.
    """

    def __init__(self, capacity: int, policy: str = "lru"):
        self.capacity = capacity
        self.policy = POLICIES[policy]()
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.hits = self.misses = self.evictions = 0

    def place(self, keys) -> list[tuple[Key, int | None, bool]]:
        """(key, slot or None when it cannot be cached, hit) for each distinct key, in file order."""
        protected = set(keys)
        placed = []
        for key in sorted(protected):  # experts are stored by index: sorted is file order
            hit = key in self.slot_of
            if hit:
                self.hits += 1
            else:
                self.misses += 1
                slot = self._claim_slot(protected)
                if slot is not None:
                    self.slot_of[key] = slot
            if key in self.slot_of:
                self.policy.touch(key)
            placed.append((key, self.slot_of.get(key), hit))
        return placed

    def _claim_slot(self, protected: set[Key]) -> int | None:
        if self.free:
            return self.free.pop()
        victim = self.policy.victim(protected)
        if victim is None:
            return None
        self.policy.forget(victim)
        self.evictions += 1
        return self.slot_of.pop(victim)


class ExpertStore:
    def __init__(self, layout: ModelLayout, cache_bytes: int, max_batch_experts: int, policy: str = "lru"):
        self.layout = layout
        self.tables = layout.expert_layers
        self.record_bytes = max((t.expert_bytes for t in self.tables.values()), default=0)
        capacity = cache_bytes // self.record_bytes if self.record_bytes else 0
        self.index = CacheIndex(capacity, policy)
        scratch = max_batch_experts if capacity < max_batch_experts else 0
        # slots [0, capacity) cache experts; the rest are scratch for a request larger than the cache
        self.slab = np.empty((capacity + scratch, self.record_bytes), dtype=np.uint8)
        self.fds = {t.file: os.open(layout.check_size(t.file), os.O_RDONLY) for t in self.tables.values()}
        self.bytes_read = 0

    @property
    def cache_bytes(self) -> int:
        return self.index.capacity * self.record_bytes

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def fetch(self, layer: int, experts) -> np.ndarray:
        """Slab rows holding `experts` of `layer`, in the order asked (int64); misses are read
        in file order. A row stays valid until the next `fetch`."""
        keys = [(layer, int(e)) for e in experts]
        scratch = iter(range(self.index.capacity, self.slab.shape[0]))
        slots: dict[Key, int] = {}
        for key, slot, hit in self.index.place(keys):
            if slot is None:
                slot = next(scratch)
            if not hit:
                self._read(key, self.slab[slot])
            slots[key] = slot
        return np.array([slots[k] for k in keys], dtype=np.int64)

    def _read(self, key: Key, buffer: np.ndarray) -> None:
        layer, expert = key
        table = self.tables[layer]
        view = buffer[: table.expert_bytes]
        got = os.preadv(self.fds[table.file], [view], table.expert_offset(expert))
        if got != table.expert_bytes:
            raise OSError(f"{self.layout.path(table.file)}: short read of layer {layer} expert {expert}")
        self.bytes_read += got

    def stats(self) -> dict:
        index = self.index
        lookups = index.hits + index.misses
        return {
            "expert_cache_bytes": self.cache_bytes,
            "expert_cache_slots": index.capacity,
            "expert_hits": index.hits,
            "expert_misses": index.misses,
            "expert_hit_rate": index.hits / lookups if lookups else 0.0,
            "expert_bytes_read": self.bytes_read,
            "expert_evictions": index.evictions,
            "cache_policy": index.policy.name,
        }
