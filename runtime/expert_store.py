"""ExpertStore: the one way the runtime reaches routed experts.

It owns a byte-budgeted cache of whole expert records (one slab of equal, page-aligned
slots, so a cached expert costs no allocation), the miss path (one `pread` of each missing
expert's contiguous record straight into its slot, a layer's misses in flight together), an
optional prefetcher (background threads reading the experts the next layer is predicted to
use while this one computes), and the statistics the user sees. Which expert to evict is decided by a small pluggable policy
object. Placement never changes the bytes: an expert read from the cache, the page cache,
the disk or ahead of time is the same record.

How experts are read (`io`):
- `pread` (buffered): each miss is a `pread` into its slot, through the page cache; expert
  files are read at random between experts and sequentially within one (`POSIX_FADV_RANDOM`:
  no readahead past the record); nothing is dropped from the page cache.
- `direct`: the same reads with `O_DIRECT`, bypassing the page cache (aligned slots and lengths).
- `mmap`: the files are mapped read-only and the kernels read a record in place
  (`mapped_experts`): no slab, no copy; the cache index keeps the resident records inside the
  budget, a miss makes its record resident, an evicted one is released.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from colibri.formats.layout import EXPERT_ALIGN, ModelLayout, align_up
from colibri.runtime.mapped_experts import MappedExperts
from colibri.runtime.memory import huge_page_buffer

Key = tuple[int, int]  # (layer, expert)
IO_MODES = {  # how experts are read (`--io`), in a line each
    "pread": "copied into the expert cache through the page cache, whose spare RAM then serves misses too",
    "direct": "copied with O_DIRECT, bypassing the page cache: RAM beyond the expert cache stays free for other programs",
    "mmap": "the files mapped and read in place: no copy, pages shared by every process that maps the model and warm "
            "after a restart; the expert cache bounds what is mapped",
}
DEFAULT_IO = "pread"  # the mode that won the common case in bench/decode.py (bench/RESULTS.md)
READ_THREADS = 4  # a layer's misses in flight at once: an NVMe needs a queue to reach its bandwidth
PREFETCH_THREADS = 2  # read-ahead has its own threads, so a miss never queues behind a guess


class LRUPolicy:
    """Least recently used: evict the expert untouched for longest."""

    name = "lru"

    def __init__(self):
        self.order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def touch_many(self, layer: int, experts: list[int]) -> None:
        """touch((layer, e)) for each of `experts`, in order."""
        order = self.order
        for expert in experts:
            key = (layer, expert)
            order[key] = None
            order.move_to_end(key)

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

    def touch_many(self, layer: int, experts: list[int]) -> None:
        """touch((layer, e)) for each of `experts`, in order."""
        for expert in experts:
            self.touch((layer, expert))

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

    def __init__(self, capacity: int, policy: str = "lru", on_evict=None):
        """`on_evict(key)` is called for each expert evicted, when given."""
        self.capacity = capacity
        self.on_evict = on_evict
        self.policy = POLICIES[policy]()
        self.slot_of: dict[Key, int] = {}
        self.slot_tables: dict[int, np.ndarray] = {}  # layer -> each expert's slot (-1: not cached), as slot_of
        self.free = list(range(capacity - 1, -1, -1))
        self.hits = self.misses = self.evictions = 0

    def place(self, keys, protected: set[Key] = frozenset(),
              read_for_this: set[Key] = frozenset()) -> list[tuple[Key, int | None, bool]]:
        """(key, slot or None when it cannot be cached, hit) for each distinct key, in file order;
        neither these keys nor `protected` are evicted to make room. Keys `read_for_this` (read
        ahead because this lookup was known to need them) count as misses."""
        protected = set(keys) | protected
        placed = []
        for key in sorted(set(keys)):  # experts are stored by index: sorted is file order
            hit = key in self.slot_of
            if hit:
                if key in read_for_this:
                    self.misses += 1
                else:
                    self.hits += 1
            else:
                self.misses += 1
                slot = self._claim_slot(protected)
                if slot is not None:
                    self._assign(key, slot)
            if key in self.slot_of:
                self.policy.touch(key)
            placed.append((key, self.slot_of.get(key), hit))
        return placed

    def hit_slots(self, layer: int, experts: np.ndarray) -> np.ndarray | None:
        """The slots (int64) of `experts` (an int64 array) of `layer` when every one is cached,
        counted and touched as `place` counts and touches hits; None, with nothing counted,
        when one is not."""
        table = self.slot_tables.get(layer)
        if table is None or not experts.size or experts.min() < 0 or experts.max() >= table.size:
            return None
        slots = table[experts]
        if slots.min() < 0:
            return None
        self.count_hits(layer, experts)
        return slots

    def count_hits(self, layer: int, experts: np.ndarray) -> None:
        """Count and touch `experts` (cached, an int64 array) of `layer` as `place` counts and
        touches hits: for a lookup made elsewhere through `slot_tables` (a kernel's)."""
        distinct = sorted(set(experts.tolist()))  # file order, as `place`
        self.hits += len(distinct)
        self.policy.touch_many(layer, distinct)

    def _assign(self, key: Key, slot: int) -> None:
        self.slot_of[key] = slot
        layer, expert = key
        table = self.slot_tables.get(layer)
        if table is None or expert >= table.size:
            grown = np.full(max(expert + 1, 2 * (0 if table is None else table.size), 64), -1, np.int64)
            if table is not None:
                grown[:table.size] = table
            self.slot_tables[layer] = table = grown
        table[expert] = slot

    def _unassign(self, key: Key) -> int:
        self.slot_tables[key[0]][key[1]] = -1
        return self.slot_of.pop(key)

    def admit(self, key: Key, protected: set[Key]) -> int | None:
        """A slot for `key`, read ahead of its use: not a lookup, so neither hit nor miss.
        None when every slot holds a protected expert."""
        slot = self._claim_slot(protected | {key})
        if slot is not None:
            self._assign(key, slot)
            self.policy.touch(key)
        return slot

    def drop(self, key: Key) -> None:
        """Forget `key` (its read failed): its slot is free again."""
        self.policy.forget(key)
        self.free.append(self._unassign(key))

    def _claim_slot(self, protected: set[Key]) -> int | None:
        if self.free:
            return self.free.pop()
        victim = self.policy.victim(protected)
        if victim is None:
            return None
        self.policy.forget(victim)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(victim)
        return self._unassign(victim)


def slot_bytes(layout: ModelLayout) -> int:
    """Bytes of one cache slot: the largest expert record of any layer, page-aligned."""
    return align_up(max((t.expert_bytes for t in layout.expert_layers.values()), default=0), EXPERT_ALIGN)


def cache_bytes_for_all(layout: ModelLayout) -> int:
    """An expert cache this large holds every routed expert of the model."""
    return slot_bytes(layout) * sum(t.count for t in layout.expert_layers.values())


class ExpertStore:
    def __init__(self, layout: ModelLayout, cache_bytes: int, max_batch_experts: int, policy: str = "lru",
                 prefetch: bool = False, io: str = DEFAULT_IO):
        """`prefetch`: read the next layer's predicted experts in the background (off by
        default: on the bench model its guesses cost more reads than they hide, see
        bench/RESULTS.md). `io`: one of IO_MODES (see the module's docstring)."""
        if io not in IO_MODES:
            raise ValueError(f"--io must be one of {', '.join(IO_MODES)}, not {io!r}")
        self.layout, self.io = layout, io
        self.tables = layout.expert_layers
        self.record_bytes = max((t.expert_bytes for t in self.tables.values()), default=0)
        # O_DIRECT reads whole aligned blocks into aligned buffers, a mapped record takes whole
        # pages: their slots are page multiples
        self.slot_bytes = self.record_bytes if io == "pread" else slot_bytes(layout)
        self.expert_count = sum(t.count for t in self.tables.values())
        capacity = min(cache_bytes // self.slot_bytes, self.expert_count) if self.slot_bytes else 0
        self.mapped: dict[int, MappedExperts] = {}
        self.uncached: list[Key] = []  # mapped records the last fetch used without a cache slot
        if io == "mmap":
            self.mapped = {layer: MappedExperts(layout.check_size(t.file), t) for layer, t in self.tables.items()}
        self.index = CacheIndex(capacity, policy, on_evict=self._release if self.mapped else None)
        scratch = max_batch_experts if capacity < max_batch_experts and not self.mapped else 0
        # slots [0, capacity) cache experts; the rest are scratch for a request larger than the
        # cache (mapped records need neither)
        self.slab = _page_aligned((0 if self.mapped else capacity + scratch, self.slot_bytes))
        self.fds = {} if self.mapped else {t.file: _open_expert_file(layout, t.file, io == "direct")
                                            for t in self.tables.values()}
        self.lock = threading.Lock()  # guards the index, `pending` and the counters
        self.pending: dict[Key, Future] = {}  # experts being read ahead, not yet landed
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="colibri-read")
        self.prefetcher = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="colibri-prefetch") if prefetch and capacity else None
        self.counters = dict(bytes_read=0, read_seconds=0.0, waited_seconds=0.0, prefetched=0, prefetch_used=0)
        self.unused_prefetches: set[Key] = set()
        self.known_reads: set[Key] = set()  # read ahead by `prefetch(speculative=False)`, not yet fetched

    def records(self, layer: int) -> np.ndarray:
        """The rows `fetch`'s slots for `layer` index: the cache slab, or the layer's mapped file."""
        return self.mapped[layer].records if self.mapped else self.slab

    @property
    def cache_bytes(self) -> int:
        return self.index.capacity * self.slot_bytes

    @property
    def bytes_read(self) -> int:
        return self.counters["bytes_read"]

    @property
    def prefetching(self) -> bool:
        return self.prefetcher is not None

    def close(self) -> None:
        for pool in (self.readers, self.prefetcher):
            if pool is not None:
                pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        for mapping in self.mapped.values():
            mapping.close()
        self.mapped.clear()

    def most_per_fetch(self) -> int:
        """How many distinct experts one `fetch` can hold at once: the cache's slots not held by
        reads ahead, or the scratch slots when the cache is smaller."""
        with self.lock:
            pending = len(self.pending)
        return max(self.index.capacity - pending, self.slab.shape[0] - self.index.capacity, 1)

    def fetch(self, layer: int, experts) -> np.ndarray:
        """Rows of `records(layer)` holding `experts` of `layer`, in the order asked (int64);
        misses are read in file order, experts being read ahead are waited for. A row stays
        valid until the next `fetch` or `prefetch`."""
        if self.uncached:
            self._release_uncached()
        experts = np.asarray(experts, dtype=np.int64).reshape(-1)
        with self.lock:  # all cached, none read ahead: only the bookkeeping
            if not self.pending and self._none_read_ahead(layer, experts):
                cached = self.index.hit_slots(layer, experts)
                if cached is not None:
                    return experts.copy() if self.mapped else cached
        keys = [(layer, int(e)) for e in experts]
        with self.lock:
            in_flight = [self.pending[k] for k in set(keys) if k in self.pending]
        self._wait(in_flight)
        scratch = iter(range(self.index.capacity, self.slab.shape[0]))
        slots: dict[Key, int] = {}
        with self.lock:
            read_for_this = self.known_reads & set(keys)
            self.known_reads -= read_for_this
            placed = self.index.place(keys, protected=set(self.pending), read_for_this=read_for_this)
            for key, _, hit in placed:
                if key in self.unused_prefetches:  # a guess read ahead, then used (or evicted unused)
                    self.unused_prefetches.discard(key)
                    self.counters["prefetch_used"] += hit
        misses = []
        for key, slot, hit in placed:
            if self.mapped:
                slots[key] = key[1]  # the record's row in its mapped file
                if slot is None:
                    self.uncached.append(key)
            else:
                slots[key] = next(scratch) if slot is None else slot
            if not hit:
                misses.append((key, slots[key]))
        if misses:  # read together (a deeper disk queue), waited for together
            started = time.perf_counter()
            reads = [(key, self.readers.submit(self._read, key, slot)) for key, slot in misses]
            failed = [(key, read.exception()) for key, read in reads if read.exception() is not None]
            if failed:
                with self.lock:
                    for key, _ in failed:
                        if key in self.index.slot_of:
                            self.index.drop(key)  # its slot holds no expert
                raise failed[0][1]
            seconds = time.perf_counter() - started
            for key, _ in misses:
                self._count_read(key, seconds / len(misses), waited=True)
        return np.array([slots[k] for k in keys], dtype=np.int64)

    def slot_table(self, layer: int) -> np.ndarray | None:
        """`layer`'s slot of each expert (int64, -1: not cached), for a kernel that looks its
        experts up itself and reads them in place from `records(layer)` until the next fetch,
        prefetch or read: None when it may not (records mapped, reads ahead in flight or not yet
        counted, a prefetcher that could change the cache meanwhile). After such a lookup
        that found every expert, `count_hits` keeps the statistics and the policy as `fetch`."""
        if self.mapped or self.prefetcher is not None or self.pending or self.known_reads or self.unused_prefetches:
            return None
        return self.index.slot_tables.get(layer)

    def count_hits(self, layer: int, experts: np.ndarray) -> None:
        """What `fetch` records of experts (int64) it found all cached, for a kernel's own lookup
        through `slot_table`."""
        with self.lock:
            self.index.count_hits(layer, experts)

    def _none_read_ahead(self, layer: int, experts: np.ndarray) -> bool:
        """Whether none of `experts` of `layer` was read ahead (and not yet fetched)."""
        if not self.known_reads and not self.unused_prefetches:
            return True
        keys = {(layer, e) for e in experts.tolist()}
        return self.known_reads.isdisjoint(keys) and self.unused_prefetches.isdisjoint(keys)

    def prefetch(self, layer: int, experts, in_use, speculative: bool = True) -> None:
        """Start reading the uncached `experts` of `layer` into free or evictable slots, in the
        background; the experts `in_use` (keys) and those still in flight keep their slots.
        A speculative read (a guess of the next layer's router, counted for the prefetch
        accuracy) needs `prefetch` on; a known one (the next experts of a layer being
        multiplied) is always made, as far as the cache has slots."""
        if speculative and not self.prefetching:
            return
        pool = self.prefetcher if speculative else self.readers
        with self.lock:
            protected = set(in_use) | set(self.pending)
            for key in sorted({(layer, int(e)) for e in experts}):
                if key in self.index.slot_of:
                    continue
                slot = self.index.admit(key, protected)
                if slot is None:
                    break
                protected.add(key)
                if speculative:
                    self.counters["prefetched"] += 1
                    self.unused_prefetches.add(key)
                else:
                    self.known_reads.add(key)
                self.pending[key] = pool.submit(self._read_ahead, key, slot)

    def _read_ahead(self, key: Key, slot: int) -> None:
        started = time.perf_counter()
        try:
            self._read(key, slot)
        except BaseException:
            with self.lock:
                self.index.drop(key)  # a later fetch misses and reads it again, raising there
                self.unused_prefetches.discard(key)
                self.known_reads.discard(key)
                del self.pending[key]
            raise
        with self.lock:
            del self.pending[key]
        self._count_read(key, time.perf_counter() - started, waited=False)

    def _wait(self, futures: list[Future]) -> None:
        started = time.perf_counter()
        for future in futures:
            try:
                future.result()
            except OSError:
                pass  # the expert was dropped from the index: fetch reads it again and reports
        if futures:
            with self.lock:
                self.counters["waited_seconds"] += time.perf_counter() - started

    def _read(self, key: Key, slot: int) -> None:
        layer, expert = key
        if self.mapped:
            self.mapped[layer].populate(expert, lambda e: (layer, e) in self.index.slot_of)
            return
        table = self.tables[layer]
        length = align_up(table.expert_bytes, EXPERT_ALIGN) if self.io == "direct" else table.expert_bytes
        got = os.preadv(self.fds[table.file], [self.slab[slot, :length]], table.expert_offset(expert))
        if got < table.expert_bytes:
            raise OSError(f"{self.layout.path(table.file)}: short read of layer {layer} expert {expert}")

    def _release(self, key: Key) -> None:
        self.mapped[key[0]].release(key[1])

    def _release_uncached(self) -> None:
        """Unmap the records the last fetch mapped without a cache slot (its rows were valid
        until this fetch), unless they have been cached since."""
        with self.lock:
            for key in self.uncached:
                if key not in self.index.slot_of:
                    self._release(key)
            self.uncached.clear()

    def resident_bytes(self) -> int | None:
        """Bytes of the expert records mapped into this process (`mmap` only; None otherwise)."""
        return sum(m.resident_bytes() for m in self.mapped.values()) if self.mapped else None

    def cached_bytes(self) -> int | None:
        """Bytes of the expert records in the page cache (`mmap` only; None otherwise)."""
        return sum(m.cached_bytes() for m in self.mapped.values()) if self.mapped else None

    def _count_read(self, key: Key, seconds: float, waited: bool) -> None:
        with self.lock:
            self.counters["bytes_read"] += self.tables[key[0]].expert_bytes
            self.counters["read_seconds"] += seconds
            if waited:
                self.counters["waited_seconds"] += seconds

    def stats(self) -> dict:
        index, c = self.index, self.counters
        lookups = index.hits + index.misses
        return {
            "expert_cache_bytes": self.cache_bytes,
            "expert_cache_slots": index.capacity,
            "expert_hits": index.hits,
            "expert_misses": index.misses,
            "expert_hit_rate": index.hits / lookups if lookups else 0.0,
            "expert_bytes_read": c["bytes_read"],
            "expert_evictions": index.evictions,
            "cache_policy": index.policy.name,
            "io": self.io,
            "expert_resident_bytes": self.resident_bytes(),
            "expert_page_cache_bytes": self.cached_bytes(),
            "prefetch": self.prefetching,
            "prefetched_experts": c["prefetched"],
            "prefetch_accuracy": c["prefetch_used"] / c["prefetched"] if c["prefetched"] else None,
            "read_seconds": c["read_seconds"],
            # waiting for a read-ahead still queued can outlast its read: nothing was hidden then
            "read_hidden_share": max(0.0, 1 - c["waited_seconds"] / c["read_seconds"]) if c["read_seconds"] else None,
        }


def _page_aligned(shape: tuple[int, int]) -> np.ndarray:
    """A zero-filled uint8 array on fresh pages (O_DIRECT needs aligned buffers)."""
    return huge_page_buffer(shape[0] * shape[1]).reshape(shape)


def _open_expert_file(layout: ModelLayout, file: str, direct_io: bool) -> int:
    path = layout.check_size(file)
    if not direct_io:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        raise OSError(f"{path}: cannot open with O_DIRECT ({e.strerror}); use --io pread or mmap") from None
