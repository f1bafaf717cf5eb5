"""The KV cache: preallocated for `ctx` positions, stored as f32, f16 or q8_0.

A layer's cache holds named streams of fixed width per position: `k` and `v` (flattened
over KV heads) for ordinary attention, or MLA's `kv`: the compressed latent followed by the
shared rotary key. q8_0 stores blocks of 32 values as int8 with one f16 scale, as
GGML's Q8_0 does: about half the bytes of f16, nearly lossless. f32 is for exactness checks against a float32 reference.

A layer whose queries see only a window of positions (gpt-oss's sliding layers) keeps only
that window, plus room for one forward pass's writes: when its rows are full, the window is
moved to their front (`first` says which position row 0 holds). A recurrent layer (a gated
DeltaNet's) keeps no positions but fixed-size float32 states, which a pass from position 0
starts from zero.

The KV slots of a batch (`KVPool`) keep each unwindowed stream of all their caches in one
array, so that a batch step writes and attends to its sequences' new positions in one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KV_KINDS = ("f32", "f16", "q8_0")
FLOAT_KINDS = {"f32": np.float32, "f16": np.float16}
Q8_BLOCK = 32
WRITE_ROOM = 512  # positions a windowed layer has room for beyond its window (a prompt chunk); more grow it


class ContextOverflow(Exception):
    """More positions than the cache was allocated for."""


BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "q8_0": (Q8_BLOCK + 2) / Q8_BLOCK}


@dataclass(frozen=True)
class CacheShape:
    """What one sequence's cache holds in each of `n_layers` layers: streams of `widths` values
    a position; `windows`[layer], the positions its queries see (0 or absent: all); `states`[layer],
    a recurrent layer's fixed-size states (name → shape; such a layer keeps no positions)."""

    n_layers: int
    widths: dict[str, int]
    windows: tuple[int, ...] = ()
    states: tuple[dict[str, tuple[int, ...]], ...] = ()
    layer_widths: tuple[dict[str, int], ...] = ()  # each layer's own streams, instead of `widths`
    entries: tuple[dict[str, tuple[int, int]], ...] = ()  # each layer's entries: name → (ratio, width)

    def widths_of(self, layer: int) -> dict[str, int]:
        return self.layer_widths[layer] if self.layer_widths else self.widths

    def entries_of(self, layer: int) -> dict[str, tuple[int, int]]:
        return self.entries[layer] if self.entries else {}

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def state(self, layer: int) -> dict[str, tuple[int, ...]]:
        return self.states[layer] if self.states else {}

    def rows(self, ctx: int) -> list[int]:
        """The positions each layer holds: `ctx`, a windowed layer's window and WRITE_ROOM, a recurrent layer's none."""
        return [0 if self.state(i) else ctx if not self.window(i) else min(ctx, self.window(i) - 1 + WRITE_ROOM)
                for i in range(self.n_layers)]

    def state_bytes(self) -> int:
        return sum(4 * math.prod(shape) for layer in range(self.n_layers) for shape in self.state(layer).values())

    def nbytes(self, ctx: int, kind: str) -> int:
        """Bytes a cache of `ctx` positions takes: f32 4, f16 2 bytes a value, q8_0 34 bytes per
        32 values; the states float32; the entries 4 bytes a value in f32, else 2."""
        streams = sum(rows * sum(self.widths_of(i).values()) for i, rows in enumerate(self.rows(ctx)))
        entries = sum(ctx // ratio * width for i in range(self.n_layers) for ratio, width in self.entries_of(i).values())
        return int(streams * BYTES_PER_VALUE[kind]) + entries * entry_dtype(kind).itemsize + self.state_bytes()


def entry_dtype(kind: str) -> np.dtype:
    """What a cache of `kind` stores entries as."""
    return np.dtype(np.float32 if kind == "f32" else np.float16)


class KVCache:
    def __init__(self, shape: CacheShape, ctx: int, kind: str = "f16", pool: KVPool | None = None, slot: int = 0,
                 allocate=np.zeros):
        """With a `pool` (of this shape, ctx and kind), the streams are its slot `slot`; the
        arrays come zeroed from `allocate(shape, dtype)` (a sweep's maps them in --scratch)."""
        if kind not in KV_KINDS:
            raise ValueError(f"--kv-quant must be one of {', '.join(KV_KINDS)}, not {kind!r}")
        widths = [shape.widths_of(i) for i in range(shape.n_layers)]
        if kind == "q8_0" and any(w % Q8_BLOCK for layer in widths for w in layer.values()):
            raise ValueError(f"q8_0 KV cache needs widths that are multiples of {Q8_BLOCK}: {shape.widths}")
        self.ctx, self.kind, self.widths = ctx, kind, dict(shape.widths)
        self.length = 0  # positions filled (the same in every layer once a forward pass ends)
        self.windows = [shape.window(i) for i in range(shape.n_layers)]
        rows = shape.rows(ctx)
        dtype = FLOAT_KINDS.get(kind, np.int8)
        self.pool, self.slot = pool, slot
        pooled = [pool is not None and not window for window in self.windows]
        self.values = [{n: pool.values[i][n][slot] if pooled[i] else allocate((r, w), dtype) for n, w in widths[i].items()}
                       for i, r in enumerate(rows)]
        if kind == "q8_0":
            self.scales = [{n: allocate((r, w // Q8_BLOCK), np.float16) for n, w in widths[i].items()}
                           for i, r in enumerate(rows)]
        self.firsts = [dict.fromkeys(layer, 0) for layer in widths]  # the position row 0 of each stream holds
        self.entries = [{n: allocate((ctx // ratio, width), entry_dtype(kind)) for n, (ratio, width) in
                         shape.entries_of(i).items()} for i in range(shape.n_layers)]
        self.states = [{n: allocate(s, np.float32) for n, s in shape.state(i).items()} for i in range(shape.n_layers)]
        self.expansions = {}  # layer -> what MLA's last prompt cut expanded (`runtime.kept_expansions`)

    @property
    def nbytes(self) -> int:
        total = sum(a.nbytes for layer in self.values + self.entries for a in layer.values())
        if self.kind == "q8_0":
            total += sum(a.nbytes for layer in self.scales for a in layer.values())
        return total + sum(a.nbytes for layer in self.states for a in layer.values())

    def states_from(self, layer: int, start: int) -> dict[str, np.ndarray]:
        """A recurrent layer's states for a pass from position `start`, updated in place by it
        (zero for a pass from position 0)."""
        states = self.states[layer]
        if start == 0:
            for array in states.values():
                array.fill(0)
        return states

    def check_room(self, start: int, count: int) -> None:
        if start + count > self.ctx:
            raise ContextOverflow(f"context full: {start} + {count} tokens exceed --ctx {self.ctx}")

    def first(self, layer: int, name: str) -> int:
        """The position row 0 of the stream holds (0 unless the layer is windowed)."""
        return self.firsts[layer][name]

    def write(self, layer: int, name: str, start: int, values: np.ndarray) -> None:
        """Store values [n, width] at positions start..start+n-1."""
        n = values.shape[0]
        self.check_room(start, n)
        kept = self.expansions.get(layer)
        if kept is not None and start < kept.upto:
            self.forget_expansion(layer)
        start = self._row_for(layer, name, start, n)
        if self.kind in FLOAT_KINDS:
            self.values[layer][name][start : start + n] = values
            return
        blocks = values.reshape(n, -1, Q8_BLOCK)
        scale = (np.abs(blocks).max(axis=2) / 127.0).astype(np.float16)
        inverse = np.divide(1.0, scale.astype(np.float32), out=np.zeros(scale.shape, np.float32), where=scale != 0)
        self.values[layer][name][start : start + n] = np.round(blocks * inverse[:, :, None]).reshape(n, -1).astype(np.int8)
        self.scales[layer][name][start : start + n] = scale

    def _row_for(self, layer: int, name: str, start: int, n: int) -> int:
        """The row position `start` is written to; a windowed layer whose rows cannot take n
        more first moves the positions the next queries still see to its front."""
        window, first = self.windows[layer], self.firsts[layer][name]
        if start == 0:
            self.firsts[layer][name] = first = 0
        if not window or start + n - first <= self.values[layer][name].shape[0]:
            if start < first:
                raise ValueError(f"position {start} is before the window the cache of layer {layer} still holds")
            return start - first
        keep = max(0, start - window + 1)  # the first position query `start` sees
        arrays = [self.values[layer]] + ([self.scales[layer]] if self.kind == "q8_0" else [])
        for streams in arrays:
            old = streams[name]
            rows = max(old.shape[0], start - keep + n)
            moved = np.zeros((rows, *old.shape[1:]), old.dtype) if rows > old.shape[0] else old
            moved[:start - keep] = old[keep - first:start - first].copy()
            streams[name] = moved
        self.firsts[layer][name] = keep
        return start - keep

    def keep_expansion(self, layer: int, expansion) -> None:
        """Keep `expansion` (made from this cache's positions 0..expansion.upto-1) for layer's next cut."""
        self.forget_expansion(layer)
        self.expansions[layer] = expansion

    def forget_expansion(self, layer: int) -> None:
        kept = self.expansions.pop(layer, None)
        if kept is not None:
            kept.release()

    def write_entries(self, layer: int, name: str, first: int, values: np.ndarray) -> None:
        """Store entries [n, width] as entries first..first+n-1 of `name`."""
        self.entries[layer][name][first:first + values.shape[0]] = values

    def entries_of(self, layer: int, name: str, count: int) -> np.ndarray:
        """Entries 0..count-1 of `name` as float32 [count, width]."""
        return self.entries[layer][name][:count].astype(np.float32, copy=False)

    def stored(self, layer: int, name: str, end: int) -> np.ndarray:
        """Positions first(layer, name)..end-1 as `kernels.attention` takes them, without a copy
        when it can: f32 as float32, f16 as its bits (uint16); q8_0 is dequantized to float32."""
        if self.kind == "f16":
            return self.values[layer][name][:end - self.firsts[layer][name]].view(np.uint16)
        return self.read(layer, name, end)

    def read(self, layer: int, name: str, end: int, begin: int | None = None) -> np.ndarray:
        """Positions `begin` (None: first(layer, name))..end-1 as float32 [rows, width]."""
        first = self.firsts[layer][name]
        rows = slice(0 if begin is None else begin - first, end - first)
        if self.kind in FLOAT_KINDS:
            return self.values[layer][name][rows].astype(np.float32, copy=False)
        q = self.values[layer][name][rows].astype(np.float32)
        q = q.reshape(q.shape[0], -1, Q8_BLOCK)
        return (q * self.scales[layer][name][rows].astype(np.float32)[:, :, None]).reshape(q.shape[0], -1)


class KVPool:
    """The streams of `count` float (f32 or f16) caches, one array [count, rows, width] each, so
    that a batch step writes, and attends to, one new position of many sequences in one call.
    Slot i is `caches[i]`; a windowed layer's streams are each cache's own (it moves them)."""

    def __init__(self, shape: CacheShape, ctx: int, kind: str, count: int, allocate=np.zeros):
        if kind not in FLOAT_KINDS:
            raise ValueError(f"a KV pool holds f32 or f16 caches, not {kind}")
        self.windows = [shape.window(i) for i in range(shape.n_layers)]
        self.values = [{n: allocate((count if not window else 0, r, w), FLOAT_KINDS[kind])
                        for n, w in shape.widths_of(i).items()} for i, (r, window) in enumerate(zip(shape.rows(ctx), self.windows))]
        self.caches = [KVCache(shape, ctx, kind, self, i, allocate) for i in range(count)]

    def holds(self, layer: int, caches) -> bool:
        """Whether `layer`'s streams of every cache of `caches` are this pool's."""
        return not self.windows[layer] and all(cache.pool is self for cache in caches)

    def write(self, layer: int, name: str, slots: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
        """Row i of values [n, width] at position positions[i] of slot slots[i] (unwindowed
        layers, where row and position are one)."""
        stream = self.values[layer][name]
        stream.reshape(-1, stream.shape[2])[slots * stream.shape[1] + positions] = values.astype(stream.dtype)

    def stored(self, layer: int, name: str) -> np.ndarray:
        """The stream of every slot [count, rows, width], as `KVCache.stored` gives it."""
        stream = self.values[layer][name]
        return stream.view(np.uint16) if stream.dtype == np.float16 else stream
