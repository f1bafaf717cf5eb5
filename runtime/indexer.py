"""Sparse attention's indexers: which cached positions each query of a layer attends to.

`Indexer` is DeepSeek's (DSA: DeepSeek-V3.2, GLM-5), over an MLA layer. Each indexed layer
keeps its own small key cache (`index_k`: a LayerNorm of one projection of the layer's input,
its first rotary dimensions rotated). A query scores a position as the sum over the indexer's
heads of weight_h × relu(q_h · k × width^-0.5), the weights a projection of the input scaled by
heads^-0.5, and attends to the `index_topk` positions that score best. With no more positions
than that, it attends to all of them: the indexer is skipped, and the attention is exactly
dense MLA. A layer that shares its indexer reuses the choice of the last layer before it that
has one.

`PoolIndexer` is GLM-5-Next's: the same scores, nothing rotated, over pools of `index_kpool`
consecutive positions, each pool's key a softmax-weighted sum of its positions' keys; a query
attends to the positions of its `index_topk / index_kpool` best complete pools and to those
after the last complete one, and to every position while it sees no more pools than that.

`BlockIndexer` is MiniMax-M3's, over a GQA layer: its cached key (one head, RMS-normalized,
rotated as the layer's keys) and its queries (one head per key-value group) score positions by
their plain dot product; a block of `index_block` positions scores its best visible one, the
`index_local_blocks` up to the query's own are always kept, and the group's query heads attend
to the positions of their `index_topk` best blocks. While a query sees no more blocks than
that, it sees all of them, and the indexer is skipped.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from colibri.formats.model_config import ModelConfig
from colibri.runtime.kernels import rms_norm
from colibri.runtime.kernels.threads import part_range, thread_count

F32 = np.float32
LAYER_NORM_EPS = 1e-6


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _index_score(q, weights, key, scale):
    """sum_h weights[h] * relu(q[h] . key * scale): DeepSeek's indexer's score of one key for one
    query (q [heads, width])."""
    total = F32(0.0)
    for h in range(q.shape[0]):
        dot = F32(0.0)
        for d in range(q.shape[1]):
            dot += q[h, d] * key[d]
        total += weights[h] * max(dot * scale, F32(0.0))
    return total


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _index_scores(q, keys, weights, start, scale, out, nthreads):
    """out[i, r] = sum_h weights[i, h] * relu(q[i, h] . keys[r] * scale) for the positions r
    query i sees (up to start + i), -inf-like elsewhere."""
    n, rows = q.shape[0], keys.shape[0]
    for t in prange(nthreads):
        lo, hi = part_range(n, nthreads, t, 1)
        for i in range(lo, hi):
            seen = start + i + 1
            for r in range(rows):
                out[i, r] = _index_score(q[i], weights[i], keys[r], scale) if r < seen else F32(-3.0e38)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """LayerNorm over the last axis (float32)."""
    mean = x.mean(-1, keepdims=True, dtype=np.float32)
    centred = x - mean
    variance = (centred * centred).mean(-1, keepdims=True, dtype=np.float32)
    return (centred / np.sqrt(variance + F32(LAYER_NORM_EPS)) * weight + bias).astype(F32)


class Indexer:
    """One layer's indexer (blk.L.indexer.*); `rope` rotates as the indexer does."""

    def __init__(self, c: ModelConfig, w, layer: int, rope):
        p = f"blk.{layer}.indexer."
        self.c, self.layer, self.rope = c, layer, rope
        self.q_b, self.k = w.linear(p + "attn_q_b.weight"), w.linear(p + "attn_k.weight")
        self.proj = w.linear(p + "proj.weight")
        self.norm_weight, self.norm_bias = w.vector(p + "k_norm.weight"), w.vector(p + "k_norm.bias")

    def keys(self, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The index keys [n, width] of the layer's input h [n, hidden] at `positions`."""
        k = layer_norm(self.k(h), self.norm_weight, self.norm_bias)
        return self.rope.apply(k[:, None, :], positions)[:, 0]

    def remember(self, cache, h: np.ndarray, positions: np.ndarray, start: int) -> None:
        """Cache the index keys of h [n, hidden] at positions start.."""
        cache.write(self.layer, "index_k", start, self.keys(h, positions))

    def sees_all(self, end: int) -> bool:
        """Whether the queries of positions before `end` attend to every position (nothing to choose)."""
        return end <= self.c.index_topk

    def queries(self, q_resid: np.ndarray, h: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(queries [n, heads, width], head weights [n, heads]) of h [n, hidden] (q_resid: its q_a norm)."""
        c, n = self.c, h.shape[0]
        q = self.rope.apply(self.q_b(q_resid).reshape(n, c.index_heads, c.index_head_dim), positions)
        return np.ascontiguousarray(q), np.ascontiguousarray(self.proj(h) * F32(c.index_heads ** -0.5), dtype=F32)

    def choose(self, q_resid: np.ndarray, h: np.ndarray, positions: np.ndarray, cache, start: int) -> np.ndarray:
        """uint8 [n, start + n] (1: attended) for the queries of h [n, hidden] (q_resid: their
        q_a norm) at positions start.., over the cached index keys of every position."""
        c, n = self.c, h.shape[0]
        keys = cache.read(self.layer, "index_k", start + n)
        q, weights = self.queries(q_resid, h, positions)
        scores = np.empty((n, keys.shape[0]), F32)
        _index_scores(q, np.ascontiguousarray(keys, dtype=F32), weights, start, F32(c.index_head_dim ** -0.5), scores,
                      thread_count())
        chosen = np.zeros(scores.shape, np.uint8)
        for i, row in enumerate(scores):
            seen = start + i + 1
            if seen <= c.index_topk:
                chosen[i, :seen] = 1
            else:  # the best index_topk; of equal scores, the earliest positions
                chosen[i, np.argsort(-row[:seen], kind="stable")[:c.index_topk]] = 1
        return chosen


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _choose_pools(q, pooled, weights, start, pool, select, chosen, nthreads):
    """chosen[i, r] = 1 for the positions r query i attends to: those of the `select` complete
    pools it sees that score best (sum_h weights[i, h] * relu(q[i, h] . pooled[j] * width^-0.5);
    of equal scores, the earliest), and those after its last complete pool; every position up to
    its own while it sees no more than `select` pools."""
    n, scale = q.shape[0], F32(q.shape[2] ** -0.5)
    for t in prange(nthreads):
        lo, hi = part_range(n, nthreads, t, 1)
        scores = np.empty(pooled.shape[0], F32)
        for i in range(lo, hi):
            end = start + i + 1
            visible = end // pool
            if visible <= select:
                chosen[i, :end] = 1
                continue
            for j in range(visible):
                scores[j] = -_index_score(q[i], weights[i], pooled[j], scale)
            for j in np.argsort(scores[:visible], kind="mergesort")[:select]:
                chosen[i, j * pool:(j + 1) * pool] = 1
            chosen[i, visible * pool:end] = 1


class PoolIndexer(Indexer):
    """GLM-5-Next's indexer of pools (blk.L.indexer.*, blk.L.indexer_compressor_{gate,ape}):
    DeepSeek's scores, without rotation, over one key a pool of `index_kpool` positions, the
    positions' index keys weighted by a softmax, over the pool, of a gate projection plus a
    bias per place in the pool, channel by channel. The cache keeps each position's key and
    gate (`index_k`) and each complete pool's key (the `index` entries)."""

    def __init__(self, c: ModelConfig, w, layer: int, rope):
        super().__init__(c, w, layer, rope)
        p = f"blk.{layer}.indexer_compressor_"
        self.gate, self.ape = w.linear(p + "gate.weight"), w.array(p + "ape.weight")

    def remember(self, cache, h: np.ndarray, positions: np.ndarray, start: int) -> None:
        """Cache the keys and gates of h [n, hidden] at positions start.., then the keys of the
        pools they complete (from the cached rows, whichever pass wrote them)."""
        kp, width, end = self.c.index_kpool, self.c.index_head_dim, start + h.shape[0]
        cache.write(self.layer, "index_k", start, np.concatenate([self.keys(h, positions), self.gate(h)], axis=1))
        done, ready = start // kp, end // kp
        if ready == done:
            return
        rows = cache.read(self.layer, "index_k", ready * kp, done * kp).reshape(ready - done, kp, 2 * width)
        logits = rows[:, :, width:] + self.ape
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        cache.write_entries(self.layer, "index", done, (rows[:, :, :width] * weights).sum(axis=1).astype(F32))

    def sees_all(self, end: int) -> bool:
        return end // self.c.index_kpool <= self.c.index_topk // self.c.index_kpool

    def choose(self, q_resid: np.ndarray, h: np.ndarray, positions: np.ndarray, cache, start: int) -> np.ndarray:
        c, n = self.c, h.shape[0]
        end = start + n
        pooled = np.ascontiguousarray(cache.entries_of(self.layer, "index", end // c.index_kpool), dtype=F32)
        q, weights = self.queries(q_resid, h, positions)
        chosen = np.zeros((n, end), np.uint8)
        _choose_pools(q, pooled, weights, start, c.index_kpool, c.index_topk // c.index_kpool, chosen, thread_count())
        return chosen


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _choose_blocks(q, keys, start, block, topk, local, chosen, nthreads):
    """chosen[i * heads + g, b] = 1 for the `topk` blocks b query i's head g scores best (a
    block: its best position up to the query's; the `local` blocks up to the query's own first;
    of equal scores, the earliest block), over keys [rows, width]."""
    n, heads, width = q.shape
    for t in prange(nthreads):
        lo, hi = part_range(n * heads, nthreads, t, 1)
        best = np.empty(keys.shape[0] // block + 1, F32)
        for item in range(lo, hi):
            i, g = item // heads, item % heads
            end = start + i + 1  # the positions the query sees
            blocks = (end - 1) // block + 1
            if blocks <= topk:
                chosen[item, :blocks] = 1
                continue
            best[:blocks] = -np.inf
            for r in range(end):
                dot = F32(0.0)
                for d in range(width):
                    dot += q[i, g, d] * keys[r, d]
                best[r // block] = max(best[r // block], dot)
            for back in range(min(local, blocks)):
                best[blocks - 1 - back] = np.inf
            for _ in range(topk):  # the best first; of equal ones, the earliest
                b = np.argmax(best[:blocks])
                best[b] = -np.inf
                chosen[item, b] = 1


class BlockIndexer:
    """One GQA layer's indexer of blocks (blk.L.indexer.*); `rope` rotates as the layer's keys."""

    def __init__(self, c: ModelConfig, w, layer: int, rope):
        p = f"blk.{layer}.indexer."
        self.c, self.rope = c, rope
        self.q, self.k = w.linear(p + "q_proj.weight"), w.linear(p + "k_proj.weight")
        self.q_norm, self.k_norm = w.vector(p + "q_norm.weight"), w.vector(p + "k_norm.weight")

    def keys(self, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The index keys [n, index_head_dim] of the layer's normalized input h [n, hidden] at `positions`."""
        k = rms_norm(self.k(h), self.k_norm, self.c.norm_eps)
        return self.rope.apply(k[:, None, :], positions)[:, 0]

    def sees_every_block(self, end: int) -> bool:
        """Whether the queries of positions before `end` see no more than index_topk blocks (all
        are attended, and `choose` has nothing to choose)."""
        return (end - 1) // self.c.index_block < self.c.index_topk

    def choose(self, h: np.ndarray, positions: np.ndarray, keys: np.ndarray, start: int) -> np.ndarray:
        """uint8 [n * index_heads, blocks of the rows] (row i * index_heads + g: the blocks the
        heads of key-value group g of query i attend to) for the queries of h [n, hidden] at
        positions start.., over the cached index keys [start + n, width]."""
        c, n = self.c, h.shape[0]
        q = rms_norm(self.q(h).reshape(n, c.index_heads, c.index_head_dim), self.q_norm, c.norm_eps)
        q = self.rope.apply(q, positions)
        chosen = np.zeros((n * c.index_heads, -(-keys.shape[0] // c.index_block)), np.uint8)
        _choose_blocks(np.ascontiguousarray(q), np.ascontiguousarray(keys, dtype=F32), start, c.index_block,
                       c.index_topk, c.index_local_blocks, chosen, thread_count())
        return chosen
