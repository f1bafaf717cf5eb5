"""Causal softmax attention over a float32 or float16 KV cache.

A decode step's attention runs on one thread, long contexts on all of them, and a prompt's
queries through `_prompt_attention`, which converts the cache to float32 once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from colibri.runtime.kernels.emitter import DOTS_AT_ONCE, float_dots, halves_into, weighted_rows_into
from colibri.runtime.kernels.numerics import softmax_in_place
from colibri.runtime.kernels.threads import part_range, thread_count

F32 = np.float32
NO_SINK = np.finfo(np.float32).min  # below softmax_in_place's threshold: no sink (finite, for fastmath)


class Seen(NamedTuple):
    """Which cached rows each query sees: cache row r holds position first_key + r; query i
    (position p = start + i) sees the `window` positions up to its own, with a `chunk` > 0 only
    those of its own chunk (p - p % chunk..p), and of them only rows r with chosen[i, r // block]
    when `chosen` has rows (an entry a `block` of rows: MiniMax-M3's choice of blocks)."""

    start: int
    first_key: int
    window: int
    chosen: np.ndarray
    chunk: int = 0
    block: int = 1


class Scoring(NamedTuple):
    """How a head's scores become weights: scaled by `scale` (float32), then a softmax with
    the head's sink logit in its denominator (sinks [heads], NO_SINK for none)."""

    sinks: np.ndarray
    scale: np.float32


def _float_row_into(row, target):
    """target[:] = a cached key or value row as float32 (float16 bits converted)."""


@overload(_float_row_into)
def _float_row_into_overload(row, target):
    if row.dtype == types.uint16:
        return lambda row, target: halves_into(row, target)

    def copied(row, target):
        target[:] = row
    return copied


@njit(cache=True, nogil=True)
def _first_row(seen, i, end):
    """The first cache row query i sees, `end` its own row + 1: the window's, or its chunk's."""
    lo = max(0, end - seen.window)
    if seen.chunk > 0:
        position = seen.start + i
        lo = max(lo, position - position % seen.chunk - seen.first_key)
    return lo


@njit(cache=True, nogil=True)
def _choice_of(chosen, i, kv, kv_heads, n):
    """Query i's row of `chosen` for kv head `kv`: its own, or, when chosen has a row per query
    and kv head (MiniMax-M3's blocks, chosen per key-value group), that one."""
    return chosen[i * kv_heads + kv] if chosen.shape[0] > n else chosen[i]


@njit(cache=True, nogil=True)
def _leave_out(scores, chosen, lo, end, block):
    """Scores of the rows `chosen` leaves out (0; an entry a `block` of rows) below every
    other, before the softmax."""
    for g in range(scores.shape[0]):
        for pos in range(lo, end):
            if not chosen[pos // block]:
                scores[g, pos] = NO_SINK


@njit(cache=True, nogil=True)
def _weigh_none(scores, chosen, lo, end, block):
    """The left-out rows' weights exactly 0, after the softmax."""
    for g in range(scores.shape[0]):
        for pos in range(lo, end):
            if not chosen[pos // block]:
                scores[g, pos] = 0.0


KEY_TILE = 8  # cached keys a decode step converts at a time, each scored by a few heads in turn (in L1)
VALUE_TILE = 16  # cached values a decode step converts at a time, then weighs for each query head (in L1)


@njit(cache=True, nogil=True, fastmath=True)
def _attend(q, keys, values, seen, scoring, out, items, share):
    """Work items first..stop-1 (`items`) of `attention`: (query, kv head) pairs, the query
    heads that share the kv head together (of them, the part-th of `parts` equal shares:
    `share`), so that each cached key and value is converted to float32 once for all of them."""
    (first, stop), (part, parts) = items, share
    start, first_key, chosen = seen.start, seen.first_key, seen.chosen
    sinks, scale = scoring
    n, heads, width = q.shape
    kv_heads, v_width = keys.shape[1], values.shape[2]
    group = heads // kv_heads
    g_lo, g_hi = part_range(group, parts, part, 1)
    mine = g_hi - g_lo
    scores = np.empty((mine, start + n - first_key), np.float32)
    keys_f, dots = np.empty((KEY_TILE, width), np.float32), np.empty(DOTS_AT_ONCE, np.float32)
    values_f, sums = np.empty((VALUE_TILE, v_width), np.float32), np.empty((mine, v_width), np.float32)
    for work in range(first, stop):
        i, kv = work // kv_heads, work % kv_heads
        end, h0 = start + i + 1 - first_key, kv * group + g_lo  # causal: query i sees rows ..end-1
        lo = _first_row(seen, i, end)
        queries = q[i, h0:h0 + mine]
        for tile_lo in range(lo, end, KEY_TILE):  # a tile of keys converted, then scored by a few heads at a time
            rows = min(KEY_TILE, end - tile_lo)
            for r in range(rows):
                _float_row_into(keys[tile_lo + r, kv], keys_f[r])
            for g0 in range(0, mine, DOTS_AT_ONCE):
                few = queries[g0:g0 + DOTS_AT_ONCE]
                for r in range(rows):
                    float_dots(few, keys_f[r], dots)  # each query head's float_dot
                    for g in range(few.shape[0]):
                        scores[g0 + g, tile_lo + r] = dots[g] * scale
        if chosen.shape[0]:
            _leave_out(scores, _choice_of(chosen, i, kv, kv_heads, n), lo, end, seen.block)
        for g in range(mine):
            softmax_in_place(scores, g, lo, end, sinks[h0 + g])
        if chosen.shape[0]:
            _weigh_none(scores, _choice_of(chosen, i, kv, kv_heads, n), lo, end, seen.block)
        sums[:] = 0.0
        for tile_lo in range(lo, end, VALUE_TILE):  # a tile of values converted, then weighed for each head
            rows = min(VALUE_TILE, end - tile_lo)
            for r in range(rows):
                _float_row_into(values[tile_lo + r, kv], values_f[r])
            for g in range(mine):
                weighted_rows_into(scores[g, tile_lo:tile_lo + rows], values_f[:rows], sums[g])
        out[i, h0:h0 + mine] = sums


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _attention_parallel(q, keys, values, seen, scoring, out, nthreads):
    """`attention` on all threads, each taking a share of the (query, kv head) pairs, or, when
    there are fewer pairs than threads (a decoded token's MLA: one), a share of every pair's
    query heads. A function of its own, not the serial one compiled twice: numba's cache
    keeps one entry per function and signature, so the two would load each other's code."""
    pairs = q.shape[0] * keys.shape[1]
    for t in prange(nthreads):
        if pairs >= nthreads:
            _attend(q, keys, values, seen, scoring, out, part_range(pairs, nthreads, t, 1), (0, 1))
        else:
            _attend(q, keys, values, seen, scoring, out, (0, pairs), (t, nthreads))


@njit(cache=True, nogil=True, fastmath=True)
def _attention_serial(q, keys, values, seen, scoring, out):
    """`attention` on this thread: a decode step's is too small to pay for waking the others."""
    _attend(q, keys, values, seen, scoring, out, (0, q.shape[0] * keys.shape[1]), (0, 1))


NO_CHOICE = np.zeros((0, 0), np.uint8)  # attention over every cached position


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _one_position_each(q, keys, values, slots, positions, scoring, out, nthreads):
    """`attention_of_slots` on all threads, each taking a share of the queries."""
    kv_heads = keys.shape[2]
    for t in prange(nthreads):
        lo, hi = part_range(q.shape[0], nthreads, t, 1)
        for i in range(lo, hi):
            end = positions[i] + 1
            seen = Seen(positions[i], 0, end + 1, NO_CHOICE, 0, 1)  # (numba's named tuples take no defaults)
            _attend(q[i:i + 1], keys[slots[i], :end], values[slots[i], :end], seen, scoring, out[i:i + 1], (0, kv_heads),
                    (0, 1))


def attention_of_slots(q, keys, values, slots, positions, scoring, out) -> None:
    """Query i (q [n, heads, width], one token at position positions[i]) over positions
    0..positions[i] of cache slot slots[i] (keys [slots, rows, kv_heads, width], values [slots,
    rows, kv_heads, v_width], as float32 or float16 bits), into out [n, heads, v_width]: what
    `attention_into` gives each query over its own cache, many sequences' decode steps in one
    call, with its `Scoring`; unchecked, as `attention_into`."""
    _one_position_each(q, keys, values, slots, positions, scoring, out, thread_count())


PARALLEL_ATTENTION_WORK = 1 << 17  # multiply-adds from which attention runs on all threads (bench/attention.py --crossover)
PROMPT_ATTENTION_QUERIES = 32  # queries from which attention converts the cache once (a prompt) ...
PROMPT_ATTENTION_BYTES = 32 << 20  # ... when the float32 copy of the cache takes at most this
QUERY_BLOCK = 16  # queries of one head whose scores a thread computes together


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _prompt_attention(q, keys, values, seen, scoring, out, nthreads):
    """`attention` for many queries. The cache is converted to float32 once ([kv head, row,
    width]); then each thread takes blocks of QUERY_BLOCK queries of one head: each cached key
    scores the whole block in one `float_dots` (the queries' fixed-order dots interleaved),
    and each query's output is its rows' values weighed in order (`weighted_rows_into`)."""
    start, first_key, window, chosen = seen.start, seen.first_key, seen.window, seen.chosen
    sinks, scale = scoring.sinks, scoring.scale
    n, heads, width = q.shape
    kv_heads, v_width, end = keys.shape[1], values.shape[2], keys.shape[0]
    group = heads // kv_heads
    keys_f = np.empty((kv_heads, end, width), np.float32)
    values_f = np.empty((kv_heads, end, v_width), np.float32)
    for t in prange(nthreads):
        lo, hi = part_range(end, nthreads, t, 1)
        for pos in range(lo, hi):
            for kv in range(kv_heads):
                _float_row_into(keys[pos, kv], keys_f[kv, pos])
                _float_row_into(values[pos, kv], values_f[kv, pos])
    blocks = (n + QUERY_BLOCK - 1) // QUERY_BLOCK
    for t in prange(nthreads):
        lo, hi = part_range(blocks * heads, nthreads, t, 1)
        scores = np.empty((QUERY_BLOCK, end), np.float32)
        outputs = np.empty((QUERY_BLOCK, v_width), np.float32)
        block = np.empty((QUERY_BLOCK, width), np.float32)
        dots = np.empty(QUERY_BLOCK, np.float32)
        for work in range(lo, hi):
            first, h = work // heads * QUERY_BLOCK, work % heads
            kv, count = h // group, min(QUERY_BLOCK, n - first)
            before = start + first - first_key  # rows every query of the block sees; query i sees up to before + i
            for i in range(count):
                block[i] = q[first + i, h]
            queries = block[:count]
            for pos in range(max(0, before + 1 - window), before + count):  # (a query ignores the rows after its own)
                float_dots(queries, keys_f[kv, pos], dots)
                for i in range(count):
                    scores[i, pos] = dots[i] * scale
            for i in range(count):
                row_lo = _first_row(seen, first + i, before + i + 1)
                if chosen.shape[0]:
                    _leave_out(scores[i:i + 1], _choice_of(chosen, first + i, kv, kv_heads, n), row_lo, before + i + 1,
                               seen.block)
                softmax_in_place(scores, i, row_lo, before + i + 1, sinks[h])
                if chosen.shape[0]:
                    _weigh_none(scores[i:i + 1], _choice_of(chosen, first + i, kv, kv_heads, n), row_lo, before + i + 1,
                                seen.block)
            outputs[:count] = 0.0
            for i in range(count):
                row_lo = _first_row(seen, first + i, before + i + 1)
                weighted_rows_into(scores[i, row_lo:before + i + 1], values_f[kv, row_lo:before + i + 1], outputs[i])
            for i in range(count):
                out[first + i, h, :] = outputs[i]


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, scale: float, window: int = 0,
              sinks: np.ndarray | None = None, first_key: int = 0, chosen: np.ndarray | None = None,
              chunk: int = 0, block: int = 1) -> np.ndarray:
    """Causal softmax attention of the n queries at positions start..start+n-1.

    q float32 [n, heads, width]; keys [rows, kv_heads, width] and values [rows, kv_heads,
    v_width], row r the position first_key + r up to start + n - 1, as float32 or as float16
    bits (uint16, read in place from an f16 KV cache); query head h reads kv head h // (heads /
    kv_heads). A `window` > 0 lets a query see only that many positions, its own the last; a
    `chunk` > 0 only those of its own chunk (positions p - p % chunk..p; Llama 4);
    `sinks` float32 [heads] are per-head logits added to the softmax's denominator (gpt-oss);
    `chosen` uint8 [n, rows] leaves out the rows a query's entry is 0 for (DeepSeek's sparse
    attention), or [n * kv_heads, rows] those of query i's row i * kv_heads + kv for the heads of
    kv head kv; with a `block` > 1 an entry stands for that many rows, [.., ceil(rows / block)]
    (MiniMax-M3's blocks, chosen per key-value group) -> float32 [n, heads, v_width]."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    n, heads, width = q.shape
    rows = start + n - first_key
    if not 0 <= first_key <= start or keys.shape[0] != rows or values.shape[0] != rows or keys.shape[2] != width \
            or heads % keys.shape[1]:
        raise ValueError(f"keys {keys.shape} / values {values.shape} from position {first_key} do not fit queries "
                         f"{q.shape} at position {start}")
    if first_key > (max(0, start - window + 1) if window > 0 else 0):
        raise ValueError(f"the cache starts at position {first_key}, after the first one position {start} sees")
    sinks = np.full(heads, NO_SINK, np.float32) if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    if sinks.shape != (heads,):
        raise ValueError(f"sinks {sinks.shape} do not fit {heads} heads")
    chosen = np.zeros((0, -(-rows // block)), np.uint8) if chosen is None else np.ascontiguousarray(chosen, dtype=np.uint8)
    if block < 1 or chosen.shape[1:] != (-(-rows // block),) or chosen.shape[0] not in (0, n, n * keys.shape[1]):
        raise ValueError(f"chosen {chosen.shape} does not fit {n} queries over {rows} cached positions in blocks of {block}")
    out = np.empty((n, heads, values.shape[2]), np.float32)
    attention_into(q, keys, values, Seen(start, first_key, window, chosen, int(chunk), int(block)),
                   Scoring(sinks, F32(scale)), out)
    return out


def attention_into(q, keys, values, seen: Seen, scoring: Scoring, out) -> None:
    """`attention` into out [n, heads, v_width] without its checks: for callers whose arrays
    are of their own making (a decode step's); `seen.chosen` [0, n or n * kv_heads, rows / block], a window of 0
    for all positions."""
    n, heads, width = q.shape
    rows = seen.start + n - seen.first_key
    if seen.window <= 0:
        seen = seen._replace(window=rows + 1)
    work = n * heads * min(rows, seen.window) * (width + values.shape[2])
    copy_bytes = 4 * rows * (keys.shape[1] * width + values.shape[1] * values.shape[2])
    args = (q, keys, values, seen, scoring, out)
    if n >= PROMPT_ATTENTION_QUERIES and copy_bytes <= PROMPT_ATTENTION_BYTES:
        _prompt_attention(*args, thread_count())
    elif work >= PARALLEL_ATTENTION_WORK:
        _attention_parallel(*args, thread_count())
    else:
        _attention_serial(*args)
