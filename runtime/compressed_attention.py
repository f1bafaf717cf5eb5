"""DeepSeek-V4's attention: one shared key-value head over a window, plus compressed entries.

Every layer's queries (`heads` of `head_dim`, from a query LoRA, each head RMS-normalized
without a weight) attend over the last `sliding_window` positions of one key-value head (K =
V, normalized, its last `rope_dim` features rotated), with a learned sink logit per head.
A layer with a compression ratio m also attends to compressed entries, each the
normalized, gated sum of a window of m positions' projections:

- m = 4 (CSA, the layers with an indexer): entry w pools positions 4(w-1)..4w+3, the
  earlier window through the first half of each projection, its own through the second; a
  query sees the `index_topk` entries its lightning indexer scores best;
- other m (HCA, 128 in the releases): entry w pools positions mw..mw+m-1; a query sees all.

Entry w is rotated at position mw and seen by queries at positions mw+m-1 and later. The
output's rotated features are turned back by the query's own angle, then go through a grouped
low-rank projection (`output_groups` groups of heads, each to `output_lora_rank`) and one
more matrix. transformers' `DeepseekV4Attention` and llama.cpp's `deepseek4` compute the
same. The cache keeps each layer's window of keys and of the compressors' per-position
projections (`KVCache` streams) and the entries made so far (`KVCache.entries`).
"""

from __future__ import annotations

import numba
import numpy as np

from colibri.formats.config_check import OVERLAPPING_RATIO
from colibri.formats.model_config import ModelConfig
from colibri.runtime import kernels
from colibri.runtime.kernels import rms_norm
from colibri.runtime.rope import Rope, RopeTable, rotated

F32 = np.float32


def unweighted_rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) over the last axis, float32."""
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=F32) + F32(eps))).astype(F32)


def rotated_tail(x: np.ndarray, table: RopeTable, positions: np.ndarray) -> np.ndarray:
    """x [n, heads, width] with its last `table.dim` features rotated at `positions`, in place."""
    x[:, :, x.shape[2] - table.dim:] = rotated(np.ascontiguousarray(x[:, :, x.shape[2] - table.dim:]), table, positions)
    return x


def inverse_table(rope: Rope) -> RopeTable:
    """The rotation by minus each position's angles."""
    return RopeTable(rope.cos, np.ascontiguousarray(-rope.sin), rope.dim, rope.interleaved)


class Compressor:
    """One series of compressed entries of a layer: `kv` and `gate` projections of the block's
    input, `ape` (a bias per place in the window), the entries' norm; `name` prefixes its
    cache streams (`name`_kv, `name`_gate) and names its entries."""

    def __init__(self, w, prefix: str, name: str, ratio: int, width: int, rope: Rope, eps: float):
        self.kv, self.gate = w.linear(prefix + "kv.weight"), w.linear(prefix + "gate.weight")
        ape = w.linear(prefix + "ape.weight")  # a 2-D weight a recipe may quantize, as llama-quantize does
        self.ape = ape.rows_f32(0, ape.rows)
        self.norm = w.vector(prefix + "norm.weight")
        self.name, self.ratio, self.width, self.rope, self.eps = name, ratio, width, rope, eps
        self.overlap = ratio == OVERLAPPING_RATIO

    def append(self, cache, layer: int, h: np.ndarray, start: int) -> None:
        """Cache the projections of h [n, hidden] (positions start..), then the entries of the
        windows they complete."""
        end, m = start + h.shape[0], self.ratio
        cache.write(layer, self.name + "_kv", start, self.kv(h))
        cache.write(layer, self.name + "_gate", start, self.gate(h))
        done, ready = start // m, end // m
        if ready == done:
            return
        first = cache.first(layer, self.name + "_kv")
        kv, gate = cache.read(layer, self.name + "_kv", end), cache.read(layer, self.name + "_gate", end)
        entries = np.empty((ready - done, self.width), F32)
        d = self.width
        for w in range(done, ready):
            own = slice(m * w - first, m * w + m - first)
            if self.overlap:  # the earlier window's first halves, then this one's second halves
                slots_kv, slots_gate = [kv[own, d:]], [gate[own, d:] + self.ape[:, d:]]
                if w:
                    earlier = slice(own.start - m, own.start)
                    slots_kv.insert(0, kv[earlier, :d])
                    slots_gate.insert(0, gate[earlier, :d] + self.ape[:, :d])
                values, logits = np.concatenate(slots_kv), np.concatenate(slots_gate)
            else:
                values, logits = kv[own], gate[own] + self.ape
            weights = np.exp(logits - logits.max(axis=0))
            weights /= weights.sum(axis=0)
            entries[w - done] = (values * weights).sum(axis=0)
        entries = rms_norm(entries, self.norm, self.eps)[:, None, :]
        positions = np.arange(done, ready, dtype=np.int64) * m
        cache.write_entries(layer, self.name, done, rotated_tail(entries, self.rope.table, positions)[:, 0])


class LightningIndexer:
    """A CSA layer's choice of entries: its own compressor's keys, queries from the query
    LoRA's normalized output, and per-head weights of the block's input:
    score(t, s) = sum over heads of weight_h * relu(q_h . key_s) / sqrt(width)."""

    def __init__(self, c: ModelConfig, w, p: str, rope: Rope):
        self.compressor = Compressor(w, p + "indexer_compressor_", "index", OVERLAPPING_RATIO, c.index_head_dim, rope,
                                     c.norm_eps)
        self.q_b, self.proj = w.linear(p + "indexer.attn_q_b.weight"), w.linear(p + "indexer.proj.weight")
        self.heads, self.width, self.topk, self.rope = c.index_heads, c.index_head_dim, c.index_topk, rope

    def queries(self, q_lora: np.ndarray, h: np.ndarray, positions: np.ndarray):
        """(queries [n, heads, width], head weights [n, heads]) of rows at `positions`."""
        q = rotated_tail(self.q_b(q_lora).reshape(-1, self.heads, self.width), self.rope.table, positions)
        return q, self.proj(h) * F32(self.heads ** -0.5)

    def choose(self, q: np.ndarray, weights: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The entries [<= topk] one query (q [heads, width], weights [heads]) attends to among
        `keys` [visible, width]: the best scores, of equal ones the earliest."""
        if keys.shape[0] <= self.topk:
            return np.arange(keys.shape[0])
        scores = np.empty(keys.shape[0], F32)
        index_scores(q, weights, keys, F32(self.width ** -0.5), scores)
        return np.argsort(-scores, kind="stable")[:self.topk]


@numba.njit(cache=True, nogil=True, parallel=True, fastmath=True)
def index_scores(q, weights, keys, scale, out):
    """out[s] = sum over heads h of weights[h] * relu(q[h] . keys[s]) * scale (the indexer's
    scores; q [heads, width], keys [entries, width])."""
    for s in numba.prange(keys.shape[0]):
        total = F32(0)
        for h in range(q.shape[0]):
            dot = F32(0)
            for j in range(q.shape[1]):
                dot += q[h, j] * keys[s, j]
            if dot > 0:
                total += weights[h] * (dot * scale)
        out[s] = total


class CompressedAttention:
    """One DeepSeek-V4 attention layer (module docstring)."""

    def __init__(self, c: ModelConfig, w, layer: int, main_rope: Rope, compress_rope: Rope):
        p = f"blk.{layer}."
        self.c, self.layer = c, layer
        self.ratio = c.compress_ratios[layer]
        self.rope = compress_rope if self.ratio else main_rope
        self.inverse = inverse_table(self.rope)
        self.q_a, self.q_b, self.kv = (w.linear(p + f"attn_{x}.weight") for x in ("q_a", "q_b", "kv"))
        self.q_a_norm, self.kv_norm = w.vector(p + "attn_q_a_norm.weight"), w.vector(p + "attn_kv_a_norm.weight")
        self.o_a, self.o_b = w.linear(p + "attn_output_a.weight"), w.linear(p + "attn_output_b.weight")
        self.sinks = w.vector(p + "attn_sinks.weight")
        self.compressor = Compressor(w, p + "attn_compressor_", "comp", self.ratio, c.head_dim, self.rope, c.norm_eps) \
            if self.ratio else None
        self.indexer = LightningIndexer(c, w, p, self.rope) if layer in c.index_layers else None

    def __call__(self, h: np.ndarray, positions: np.ndarray, segments: list) -> np.ndarray:
        """h [n, hidden] (the block's normalized input) at `positions` [n]; each segment's rows
        attend over its own cache."""
        c, n = self.c, h.shape[0]
        q_lora = rms_norm(self.q_a(h), self.q_a_norm, c.norm_eps)
        q = unweighted_rms_norm(self.q_b(q_lora).reshape(n, c.n_heads, c.head_dim), c.norm_eps)
        q = rotated_tail(q, self.rope.table, positions)
        kv = rotated_tail(rms_norm(self.kv(h), self.kv_norm, c.norm_eps)[:, None, :], self.rope.table, positions)[:, 0]
        index = self.indexer.queries(q_lora, h, positions) if self.indexer else None
        out = np.empty((n, c.n_heads, c.head_dim), F32)
        for s in segments:
            cache = s.cache
            cache.write(self.layer, "kv", s.start, kv[s.rows])
            for compressor in (self.compressor, self.indexer and self.indexer.compressor):
                if compressor:
                    compressor.append(cache, self.layer, h[s.rows], s.start)
            out[s.rows] = self.attend(q[s.rows], s, index and (index[0][s.rows], index[1][s.rows]))
        out = rotated_tail(out, self.inverse, positions)
        groups = c.output_groups
        if self.o_a.observe is not None:  # what each group's rows of attn_output_a multiply, pooled
            self.o_a.observe(out.reshape(n * groups, -1))
        grouped = self.o_a.times_per_head(out.reshape(n * groups, -1), groups, c.output_lora_rank, c.output_lora_rank)
        return self.o_b(grouped.reshape(n, groups * c.output_lora_rank))

    def attend(self, q: np.ndarray, s, index) -> np.ndarray:
        """Segment s's queries q [count, heads, width] over their window and the entries they
        see, in one attention call: the rows are the entries, then the cached window (K = V);
        `chosen` keeps, for each query, its window and its visible (CSA: indexed) entries."""
        c, cache = self.c, s.cache
        first, window = cache.first(self.layer, "kv"), cache.read(self.layer, "kv", s.end)
        made = s.end // self.ratio if self.ratio else 0
        entries = cache.entries_of(self.layer, "comp", made) if made else np.empty((0, c.head_dim), F32)
        keys = np.concatenate([entries, window])[:, None, :]
        index_keys = cache.entries_of(self.layer, "index", made) if self.indexer else None
        chosen = np.zeros((s.count, keys.shape[0]), np.uint8)
        for i, t in enumerate(range(s.start, s.end)):
            chosen[i, made + max(t - c.sliding_window + 1, first) - first:] = 1  # the window (rows past t: causal)
            visible = (t + 1) // self.ratio if self.ratio else 0
            if self.indexer and visible:
                chosen[i, self.indexer.choose(index[0][i], index[1][i], index_keys[:visible])] = 1
            else:
                chosen[i, :visible] = 1
        start = keys.shape[0] - s.count  # the segment's last rows are its own positions
        return kernels.attention(q, keys, keys, start, F32(c.head_dim ** -0.5), sinks=self.sinks, chosen=chosen)
