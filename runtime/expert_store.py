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


POLICIES = {"lru": LRUPolicy}


class ExpertStore:
    def __init__(self, layout: ModelLayout, cache_bytes: int, max_batch_experts: int, policy: str = "lru"):
        self.layout = layout
        self.tables = layout.expert_layers
        self.record_bytes = max((t.expert_bytes for t in self.tables.values()), default=0)
        self.capacity = cache_bytes // self.record_bytes if self.record_bytes else 0
        scratch = max_batch_experts if self.capacity < max_batch_experts else 0
        # slots [0, capacity) cache experts; the rest are scratch for a request larger than the cache
        self.slab = np.empty((self.capacity + scratch, self.record_bytes), dtype=np.uint8)
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(self.capacity - 1, -1, -1))
        self.policy = POLICIES[policy]()
        self.fds = {t.file: os.open(layout.path(t.file), os.O_RDONLY) for t in self.tables.values()}
        self.hits = self.misses = self.bytes_read = self.evictions = 0

    @property
    def cache_bytes(self) -> int:
        return self.capacity * self.record_bytes

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def fetch(self, layer: int, experts) -> list[np.ndarray]:
        """The records of `experts` of `layer`, in the order asked; misses are read in file order."""
        keys = [(layer, int(e)) for e in experts]
        protected = set(keys)
        records: dict[Key, np.ndarray] = {}
        scratch = iter(range(self.capacity, self.slab.shape[0]))
        for key in sorted(protected):  # file order: experts are stored by index
            if key in self.slot_of:
                self.hits += 1
                slot = self.slot_of[key]
            else:
                self.misses += 1
                slot = self._claim_slot(protected)
                if slot is None:
                    slot = next(scratch)
                else:
                    self.slot_of[key] = slot
                self._read(key, self.slab[slot])
            if key in self.slot_of:
                self.policy.touch(key)
            records[key] = self.slab[slot, : self.tables[layer].expert_bytes]
        return [records[k] for k in keys]

    def _claim_slot(self, protected: set[Key]) -> int | None:
        if self.free:
            return self.free.pop()
        victim = self.policy.victim(protected)
        if victim is None:
            return None
        self.policy.forget(victim)
        self.evictions += 1
        return self.slot_of.pop(victim)

    def _read(self, key: Key, buffer: np.ndarray) -> None:
        layer, expert = key
        table = self.tables[layer]
        view = buffer[: table.expert_bytes]
        got = os.preadv(self.fds[table.file], [view], table.expert_offset(expert))
        if got != table.expert_bytes:
            raise OSError(f"{self.layout.path(table.file)}: short read of layer {layer} expert {expert}")
        self.bytes_read += got

    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return {
            "expert_cache_bytes": self.cache_bytes,
            "expert_cache_slots": self.capacity,
            "expert_hits": self.hits,
            "expert_misses": self.misses,
            "expert_hit_rate": self.hits / lookups if lookups else 0.0,
            "expert_bytes_read": self.bytes_read,
            "expert_evictions": self.evictions,
            "cache_policy": self.policy.name,
        }
