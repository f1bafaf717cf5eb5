"""The forward pass, driven only by the normalized config (`formats.model_config`) and each
layer's record (`runtime.layer_record`, which the fused decode steps of `runtime.fused` run too).

One decoder serves every architecture: attention is GQA/MHA (with optional q/k/v bias,
per-head or whole-projection q/k RMSNorm, partial or interleaved rotary, an output gate) or
MLA (the compressed latent is what the KV cache holds, queries are absorbed into it), or a
layer's token mixer is a gated DeltaNet (`runtime.deltanet`); the FFN is dense or a routed
mixture with optional shared experts. Resident tensors are read into RAM once; routed experts
come through the `ExpertStore`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from colibri.formats.config_check import EXPERT_ID_TABLE, OVERLAPPING_RATIO
from colibri.formats.encodings import FLOAT_DTYPES
from colibri.formats.layout import FormatError, ModelLayout, align_up
from colibri.formats.model_config import ModelConfig
from colibri.runtime import fused, hyper_connections, kept_expansions, kernels
from colibri.runtime.compressed_attention import CompressedAttention
from colibri.runtime.deltanet import GatedDeltaNet, mixer_for
from colibri.runtime.expert_store import ExpertStore
from colibri.runtime.indexer import BlockIndexer, Indexer, PoolIndexer
from colibri.runtime.kept_expansions import EXPANDED_MLA_KEEP_BYTES, ExpansionBudget
from colibri.runtime.kernels.attention import Scoring
from colibri.runtime.kernels.routing import route_by, weigh_chosen
from colibri.runtime.kv_cache import CacheShape, KVCache
from colibri.runtime.layer_record import LayerRecord, describe_layer
from colibri.runtime.layer_steps import finish_qkv
from colibri.runtime.memory import huge_page_buffer
from colibri.runtime.rope import Rope, rotated


rms_norm = kernels.rms_norm
CACHE_LINE = 64  # resident tensors start on a cache line
EXPANDED_MLA_QUERIES = 64  # a segment's queries from which MLA attends with keys and values expanded by kv_b
EXPANDED_MLA_BYTES = 16 << 20  # their float32 keys and values at a time (a group of heads)


class Weights:
    """Resident tensors read from the layout into RAM (`pread`, not mmap: the RSS is ours),
    back to back in one buffer on huge pages."""

    def __init__(self, layout: ModelLayout):
        self.layout = layout
        self.raw: dict[str, np.ndarray] = {}
        self.matrices: dict[str, kernels.Matrix] = {}
        starts = np.cumsum([0] + [align_up(info.nbytes, CACHE_LINE) for info in layout.tensors.values()])
        memory = huge_page_buffer(int(starts[-1]))
        fds: dict[str, int] = {}
        try:
            for (name, info), start in zip(layout.tensors.items(), starts):
                if info.file not in fds:
                    fds[info.file] = os.open(layout.check_size(info.file), os.O_RDONLY)
                buffer = memory[start:start + info.nbytes]
                if os.preadv(fds[info.file], [buffer], info.offset) != info.nbytes:
                    raise OSError(f"{layout.path(info.file)}: short read of {name}")
                self.raw[name] = buffer
        finally:
            for fd in fds.values():
                os.close(fd)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.raw.values())

    def has(self, name: str) -> bool:
        return name in self.raw

    def linear(self, name: str) -> kernels.Matrix:
        """The matrix `name` (one object per name: `matrices` lists them)."""
        if name not in self.matrices:
            info = self.layout.tensors[name]
            self.matrices[name] = kernels.Matrix(self.raw[name], info.encoding, *info.shape)
        return self.matrices[name]

    def vector(self, name: str) -> np.ndarray:
        """A float (norm, bias) tensor as float32, flat."""
        info = self.layout.tensors[name]
        data = self.raw[name].view(FLOAT_DTYPES[info.encoding])
        if info.encoding == "BF16":
            return (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32)

    def array(self, name: str) -> np.ndarray:
        """A float tensor as float32 in its shape (the experts' biases [experts, width])."""
        return self.vector(name).reshape(self.layout.tensors[name].shape)


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens in a forward pass: rows `first`.. of the pass, `count` of them,
    placed at positions `start`.. of the sequence's own KV cache."""

    first: int
    count: int
    start: int
    cache: KVCache

    @property
    def rows(self) -> slice:
        return slice(self.first, self.first + self.count)

    @property
    def end(self) -> int:
        return self.start + self.count


def pooled_tokens(segments: list[Segment], layer: int) -> tuple[tuple | None, list[Segment]]:
    """The segments of one token whose caches share a `KVPool` holding `layer`, as (pool, their
    rows, slots and positions), when two or more do, and the segments left; else (None, segments)."""
    ones = [s for s in segments if s.count == 1]
    pool = ones[0].cache.pool if ones else None
    if len(ones) < 2 or pool is None or not pool.holds(layer, [s.cache for s in ones]):
        return None, segments
    rows, slots, at = (np.array(values, np.int64) for values in zip(*((s.first, s.cache.slot, s.start) for s in ones)))
    return (pool, rows, slots, at), [s for s in segments if s.count != 1]


def attention_of_slots(q, keys, values, slots, positions, scoring: Scoring) -> np.ndarray:
    """`kernels.attention_of_slots` of q [n, heads, width] (rows of a batch) into a new array."""
    out = np.empty((q.shape[0], q.shape[1], values.shape[3]), np.float32)
    kernels.attention_of_slots(np.ascontiguousarray(q, dtype=np.float32), keys, values, slots, positions, scoring, out)
    return out


class Attention:
    """GQA / MHA with the variants of the supported architectures, as its `LayerRecord` says;
    with an `indexer` (MiniMax-M3's sparse layers: `runtime.indexer.BlockIndexer`), each query
    attends to the blocks of positions it chooses for the query's key-value group."""

    def __init__(self, c: ModelConfig, record: LayerRecord, indexer: BlockIndexer | None = None):
        m = record.matrices
        self.c, self.layer, self.record, self.indexer = c, record.layer, record, indexer
        self.q, self.k, self.v, self.o = m["q"], m["k"], m["v"], m["o"]
        self.gate = m.get("gate")  # Qwen3-Next's output gate: its rows of attn_q, held apart from the query's
        self.o_bias = record.output.o_bias if record.output.o_bias.size else None
        self.window, self.scoring, self.kv_heads = record.window, record.scoring, record.mixer.kv_heads

    def __call__(self, h: np.ndarray, positions: np.ndarray, segments: list[Segment]) -> np.ndarray:
        """h [n, hidden] at `positions` [n]; each segment's rows attend over its own cache."""
        c, n = self.c, h.shape[0]
        q, k, v, gate = self.rotated_qkv(h, positions)
        k = k.reshape(n, -1)
        out = np.empty((n, c.n_heads, c.v_head_dim), np.float32)
        pooled, segments = pooled_tokens(segments, self.layer) if self.indexer is None else (None, segments)
        index_keys = None if self.indexer is None else self.indexer.keys(h, positions)
        if pooled is not None:
            pool, rows, slots, at = pooled
            pool.write(self.layer, "k", slots, at, k[rows])
            pool.write(self.layer, "v", slots, at, v[rows])
            keys, values = pool.stored(self.layer, "k"), pool.stored(self.layer, "v")
            keys = keys.reshape(*keys.shape[:2], self.kv_heads, c.head_dim)
            values = values.reshape(*values.shape[:2], self.kv_heads, c.v_head_dim)
            out[rows] = attention_of_slots(q[rows], keys, values, slots, at, self.scoring)
        for s in segments:
            s.cache.write(self.layer, "k", s.start, k[s.rows])
            s.cache.write(self.layer, "v", s.start, v[s.rows])
            first = s.cache.first(self.layer, "k")
            keys = s.cache.stored(self.layer, "k", s.end).reshape(s.end - first, self.kv_heads, c.head_dim)
            values = s.cache.stored(self.layer, "v", s.end).reshape(s.end - first, self.kv_heads, c.v_head_dim)
            chosen = None if self.indexer is None else self.choose(s.cache, h[s.rows], positions[s.rows], s.start,
                                                                   index_keys[s.rows])
            out[s.rows] = kernels.attention(q[s.rows], keys, values, s.start, self.scoring.scale, self.window,
                                            self.scoring.sinks, first, chosen, self.record.chunk, c.index_block or 1)
        out = out.reshape(n, c.n_heads * c.v_head_dim)
        if gate is not None:  # Qwen3-Next's output gate
            out = kernels.sigmoid_gated(out, gate)
        out = self.o(out)
        return out if self.o_bias is None else out + self.o_bias

    def choose(self, cache: KVCache, h: np.ndarray, positions: np.ndarray, start: int,
               index_keys: np.ndarray) -> np.ndarray | None:
        """What the queries of h [n, hidden] at positions start.. attend to (the indexer's
        choice of blocks: uint8 [n * kv heads, blocks], None for all), after caching their index keys."""
        end = start + h.shape[0]
        cache.write(self.layer, "index_k", start, index_keys)
        if self.indexer.sees_every_block(end):  # (without reading the cached keys)
            return None
        return self.indexer.choose(h, positions, cache.read(self.layer, "index_k", end), start)

    def rotated_qkv(self, h: np.ndarray, positions: np.ndarray):
        """q [n, heads, width], k [n, kv heads, width] and v [n, kv heads * v width] of h with
        their bias, norms, clip and rotation (`layer_steps.finish_qkv`, as a decoded token's);
        the output gate [n, heads * width] (None without)."""
        c, n = self.c, h.shape[0]
        q, k, v, *gate = kernels.products(h, (self.q, self.k, self.v) + ((self.gate,) if self.gate else ()))
        finish_qkv(self.record.mixer, q, k, v, np.asarray(positions, dtype=np.int64))
        return q.reshape(n, c.n_heads, c.head_dim), k.reshape(n, self.kv_heads, c.head_dim), v, gate[0] if gate else None


class LatentAttention:
    """MLA: the cache holds the normalized latent and the shared rotary key; queries are
    absorbed into the latent space (exactly equal to expanding keys and values). With
    DeepSeek's sparse attention, a query attends to the positions its layer's indexer chooses
    (`runtime.indexer`), or the indexer of the layer it `shares`."""

    def __init__(self, c: ModelConfig, w: Weights, record: LayerRecord, budget: ExpansionBudget,
                 index_rope: Rope | None = None):
        m, layer = record.matrices, record.layer
        self.c, self.layer, self.record = c, layer, record
        self.budget = budget  # for the expansions a sequence keeps between its prompt's cuts
        self.rope = record.mixer.rope
        self.latent_eps = record.mixer.latent_eps
        indexer = PoolIndexer if c.index_kpool else Indexer
        self.indexer = indexer(c, w, layer, index_rope) if layer in c.index_layers else None
        self.shares: LatentAttention | None = None  # the layer whose indexer's choice this one reuses
        # indexer layers: id(cache) -> {a pass's start position: its choice}, for the passes whose
        # forward is not over (a sweep runs all of a layer's passes before the next layer's)
        self.choices: dict[int, dict[int, np.ndarray | None]] = {}
        if record.lora is not None:
            self.q_a, self.q_b = m["q_a"], m["q_b"]
            self.q_a_norm = record.lora.q_a_norm
        else:
            self.q = m["q"]
        self.kv_a, self.kv_b, self.k_absorb, self.o = m["kv_a"], m["kv_b"], m["k_absorb"], m["o"]
        self.kv_a_norm = record.mixer.kv_a_norm
        self.scoring = record.scoring

    def __call__(self, h: np.ndarray, positions: np.ndarray, segments: list[Segment]) -> np.ndarray:
        c, n = self.c, h.shape[0]
        heads, nope, rope_dim, rank = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        q_resid = rms_norm(self.q_a(h), self.q_a_norm, self.latent_eps) if c.q_lora_rank else None
        q = self.q_b(q_resid) if c.q_lora_rank else self.q(h)
        q = q.reshape(n, heads, nope + rope_dim)
        q_pe = rotated(q[:, :, nope:], self.rope, positions)
        compressed = self.kv_a(h)
        latent = rms_norm(compressed[:, :rank], self.kv_a_norm, self.latent_eps)
        if self.kv_b.observe is not None:  # what kv_b multiplies, though absorbed it never runs as a product
            self.kv_b.observe(latent)
        k_pe = rotated(compressed[:, None, rank:], self.rope, positions)[:, 0]
        stored = np.concatenate([latent, k_pe], axis=1)
        pooled, segments = pooled_tokens(segments, self.layer) if not c.index_topk else (None, segments)
        absorbed = np.ones(n, bool)  # the rows that attend in the latent space
        for s in segments:
            if s.count >= EXPANDED_MLA_QUERIES:
                absorbed[s.rows] = False
            else:  # a prompt's last short cut, or a decoded token: no expanded cut of it follows
                s.cache.forget_expansion(self.layer)
        rows = np.flatnonzero(absorbed)
        queries = np.empty((n, heads, rank + rope_dim), np.float32)  # the absorbed rows' [q_nope absorbed | q_pe]
        if rows.size:
            queries[rows, :, :rank] = self.k_absorb.times_per_head(q[rows, :, :nope].reshape(-1, nope), heads, rank,
                                                                   rank).reshape(-1, heads, rank)
            queries[rows, :, rank:] = q_pe[rows]
        context = np.empty((n, heads, rank), np.float32)  # the absorbed rows' attention output, in the latent space
        attended = np.empty((n, heads, c.v_head_dim), np.float32)
        if pooled is not None:
            pool, pooled_rows, slots, at = pooled
            pool.write(self.layer, "kv", slots, at, stored[pooled_rows])
            keys = pool.stored(self.layer, "kv")[:, :, None, :]
            context[pooled_rows] = attention_of_slots(queries[pooled_rows], keys, keys[:, :, :, :rank], slots, at,
                                                      self.scoring)
        for s in segments:
            s.cache.write(self.layer, "kv", s.start, stored[s.rows])
            chosen = self.choose(s.cache, q_resid[s.rows], h[s.rows], positions[s.rows], s.start) if c.index_topk else None
            if not absorbed[s.first]:
                attended[s.rows] = self.expanded(q[s.rows, :, :nope], q_pe[s.rows], s, chosen)
                continue
            # multi-query attention over the cache in place: keys [latent | rotated part], values the latent
            keys = s.cache.stored(self.layer, "kv", s.end)[:, None, :]
            context[s.rows] = kernels.attention(queries[s.rows], keys, keys[:, :, :rank], s.start, self.scoring.scale,
                                                chosen=chosen)
        if rows.size:
            attended[rows] = self.kv_b.times_per_head(context[rows].reshape(-1, rank), heads, c.v_head_dim,
                                                      nope + c.v_head_dim, first=nope).reshape(-1, heads, c.v_head_dim)
        return self.o(attended.reshape(n, heads * c.v_head_dim))

    def expanded(self, q_nope: np.ndarray, q_pe: np.ndarray, s: Segment, chosen: np.ndarray | None) -> np.ndarray:
        """Segment s's attention output [count, heads, v_head_dim] with each head's keys [k_nope |
        k_pe] and values expanded from the cached latents by kv_b: (nope + rope) + v multiply-adds
        per head and position instead of the latent space's 2 * rank + rope, for the price of kv_b
        on every cached position (a prompt's queries skip their absorption and output product).
        Heads in groups whose float32 keys and values fit EXPANDED_MLA_BYTES. The expansion
        of every head is kept for the sequence's next cut (`runtime.kept_expansions`) while the
        budget allows; else each group's is made and dropped."""
        c = self.c
        heads, nope, rope_dim, rank, v = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        cached = s.cache.read(self.layer, "kv", s.end)
        k_pe, per_head, row_bytes = cached[:, None, rank:], nope + v, self.kv_b.row_nbytes
        kept = kept_expansions.expand(s.cache, self.layer, cached[:, :rank], self.kv_b, (heads, per_head), self.budget)
        act = self.kv_b.activation(np.ascontiguousarray(cached[:, :rank])) if kept is None else None
        group = max(1, min(heads, EXPANDED_MLA_BYTES // (4 * s.end * (nope + rope_dim + v))))
        out = np.empty((s.count, heads, v), np.float32)
        for first in range(0, heads, group):
            g = min(group, heads - first)
            if kept is not None:
                kv = kept.heads(first, g)
            else:
                part = kernels.Matrix(self.kv_b.data[first * per_head * row_bytes:(first + g) * per_head * row_bytes],
                                      self.kv_b.encoding, g * per_head, rank)
                kv = part.times(act, s.end).reshape(s.end, g, per_head)
            keys = np.empty((s.end, g, nope + rope_dim), np.float32)
            keys[:, :, :nope], keys[:, :, nope:] = kv[:, :, :nope], k_pe
            queries = np.concatenate([q_nope[:, first:first + g], q_pe[:, first:first + g]], axis=2)
            out[:, first:first + g] = kernels.attention(queries, keys, kv[:, :, nope:], s.start, self.scoring.scale,
                                                        chosen=chosen)
        return out


    def choose(self, cache: KVCache, q_resid: np.ndarray, h: np.ndarray, positions: np.ndarray,
               start: int) -> np.ndarray | None:
        """Which cached positions the queries of h [n, hidden] at positions start.. attend to
        (uint8 [n, start + n]), None for all; an indexer layer first caches their index keys.
        q_resid: the queries' q_a norm (rows of this cache's sequence only)."""
        if self.indexer is None:
            return None if self.shares is None else self.shares.choices.get(id(cache), {}).get(start)
        self.indexer.remember(cache, h, positions, start)
        chosen = None
        if not self.indexer.sees_all(start + h.shape[0]):
            chosen = self.indexer.choose(q_resid, h, positions, cache, start)
        pending = {at: kept for at, kept in self.choices.get(id(cache), {}).items() if cache.length <= at < start}
        self.choices[id(cache)] = {**pending, start: chosen}
        return chosen


class DenseFFN:
    """down(glu(gate(h), up(h))), `glu` a `kernels.GLU` (silu(gate) * up unless given)."""

    def __init__(self, gate: kernels.Matrix, up: kernels.Matrix, down: kernels.Matrix, glu: kernels.GLU = kernels.SILU):
        self.gate, self.up, self.down, self.glu = gate, up, down, glu

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return self.down(kernels.glu_times(self.gate(h), self.up(h), self.glu))


class Router:
    """Scores, the choice of top-k experts and their weights, per the layer's `RouterInput`."""

    def __init__(self, c: ModelConfig, record: LayerRecord):
        self.k, self.input = c.n_experts_used, record.router
        self.gate = record.matrices["router"]
        self.bias = record.router.bias
        self.logit_bias = record.router.logit_bias if record.router.logit_bias.size else None

    def __call__(self, h: np.ndarray, tokens=None) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids [n, k], weights [n, k]) of h [n, hidden] (the rows' `tokens` play no part)."""
        logits = self.gate(h) if self.logit_bias is None else self.gate(h) + self.logit_bias
        return route_by(logits, self.bias, self.k, self.input.rule)


class HashRouter(Router):
    """DeepSeek-V4's first layers: a table chooses each token's experts, the router only weighs them."""

    def __init__(self, c: ModelConfig, record: LayerRecord, w: Weights):
        super().__init__(c, record)
        name = f"blk.{record.layer}.{EXPERT_ID_TABLE}"
        table = w.array(name)
        if not np.all((table >= 0) & (table < c.n_experts) & (table == np.floor(table))):
            raise FormatError(f"{w.layout.path(w.layout.tensors[name].file)}: {name} holds expert ids outside "
                              f"0..{c.n_experts - 1}")
        self.table = table.astype(np.int64)

    def __call__(self, h: np.ndarray, tokens=None) -> tuple[np.ndarray, np.ndarray]:
        ids = self.table[np.asarray(tokens, dtype=np.int64)]
        return ids, weigh_chosen(self.gate(h), ids, self.input.rule)


class MoE:
    def __init__(self, c: ModelConfig, record: LayerRecord, store: ExpertStore, router: Router | None = None):
        self.layer, self.store = record.layer, store
        self.router = router or Router(c, record)
        self.experts = record.experts
        self.input_scaled = c.expert_input_scaled
        m = record.matrices
        self.shared = SharedExpert(m["ffn_gate"], m["ffn_up"], m["ffn_down"], m.get("shared_gate"), record.ffn.glu) \
            if record.ffn is not None else None
        self.last_route: tuple[np.ndarray, np.ndarray] | None = None
        self.last_distinct = 0  # distinct experts the last call used
        self.observe = None  # called as observe(this MoE, h, expert ids) before each call's experts run, when set
        # (next MoE layer, its FFN norm weight / ours): h times the ratio is what the next
        # router would see if this layer and the next attention added nothing
        self.lookahead: tuple[MoE, np.ndarray] | None = None

    def __call__(self, h: np.ndarray, batch_invariant: bool = False, tokens=None, out: np.ndarray | None = None) -> np.ndarray:
        """The layer's FFN of h [n, hidden]; `tokens` [n], the rows' token ids, for a hash layer's
        router; `out`, float32 like h, the array it is written into (default: a new one)."""
        return self.apply(h, *self.router(h, tokens), batch_invariant, out)

    def apply(self, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, batch_invariant: bool = False,
              out: np.ndarray | None = None) -> np.ndarray:
        """The routed experts `ids` [n, k] chose for h [n, hidden], mixed with `weights` [n, k],
        plus the shared experts (written into `out` of many rows, when given)."""
        out = self.routed(h, ids, weights, batch_invariant, out)
        if self.shared is not None:
            out = np.add(out, self.shared(h), out=out)
        return out

    def routed(self, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, batch_invariant: bool = False,
               out: np.ndarray | None = None) -> np.ndarray:
        """The routed experts' part of `apply`. A single row takes the one-token kernel unless
        `batch_invariant` asks for the many-row path whatever the row count (their sums differ
        in the last bits); many rows are added up in `out` when given. Llama 4's weight scales
        the expert's input instead (one expert a row)."""
        self.last_route = ids, weights
        if self.input_scaled:
            h, weights = h * weights, np.ones_like(weights)
        if self.observe is not None:
            self.observe(self, h, ids)
        if h.shape[0] == 1 and not batch_invariant:
            self.last_distinct = ids.shape[1]  # a row's top-k are distinct experts
            slots = self.store.fetch(self.layer, ids[0])
            self.prefetch_next(h, ids[0])
            return self.experts(self.store.records(self.layer), slots, h[0], weights[0], ids[0])[None, :]
        return self.apply_rows(h, ids, weights, out)

    def ran_cached(self, ids: np.ndarray, weights: np.ndarray) -> None:
        """What `routed` records of a row [1, k] whose experts a fused kernel found in the
        store's slot table and ran itself."""
        self.last_route = ids, weights
        self.last_distinct = ids.shape[1]
        self.store.count_hits(self.layer, ids[0])

    def apply_rows(self, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The routed experts of many rows: the rows grouped by expert, each needed expert read
        once, in file order, half as many at a time as the cache holds (the next half is read
        while this one is multiplied), and each such run of groups multiplied in one call (on
        AMX tiles or exactly: one call per expert); outputs added in expert order, from zero,
        into `out` (default: a new array)."""
        if out is None:
            out = np.zeros_like(h)
        else:
            out.fill(0.0)
        acts = self.experts.activations(h)  # quantized once for all the experts
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")  # by expert, then by row: np.nonzero's order
        experts, starts = np.unique(flat[order], return_index=True)
        self.last_distinct = experts.size
        starts = np.append(starts, order.size).astype(np.int64)
        rows, routed = (order // ids.shape[1]).astype(np.int64), weights.reshape(-1)[order].astype(np.float32)
        grouped, records = self.experts.groupable(acts), self.store.records(self.layer)
        at_once = max(self.store.most_per_fetch() // 2, 1) if grouped else 1
        for first in range(0, experts.size, at_once):
            stop = min(first + at_once, experts.size)
            slots = self.store.fetch(self.layer, experts[first:stop])
            if stop < experts.size:
                self.store.prefetch(self.layer, experts[stop:stop + at_once], speculative=False,
                                    in_use={(self.layer, int(e)) for e in experts[first:stop]})
            mine, mixed = rows[starts[first]:starts[stop]], routed[starts[first]:starts[stop]]
            if grouped:
                self.experts.grouped(records, slots, starts[first:stop + 1] - starts[first], mine, mixed, acts, out,
                                     experts[first:stop].astype(np.int64))
            else:
                y = self.experts.batch(records[slots[0]], self.experts.rows_of(acts, mine), mine.size, int(experts[first]))
                kernels.add_weighted_rows(out, mine, y, mixed)
        return out

    def prefetch_next(self, h: np.ndarray, in_use: np.ndarray) -> None:
        """Start reading the experts the next MoE layer's router picks for the current hidden state."""
        if self.lookahead is None or not self.store.prefetching:
            return
        following, norm_ratio = self.lookahead
        predicted, _ = following.router(h * norm_ratio)
        self.store.prefetch(following.layer, predicted[0], in_use={(self.layer, int(e)) for e in in_use})


class SharedExpert(DenseFFN):
    """The shared experts' FFN, scaled by a sigmoid of its own gate when it has one."""

    def __init__(self, gate: kernels.Matrix, up: kernels.Matrix, down: kernels.Matrix,
                 sigmoid_gate: kernels.Matrix | None, glu: kernels.GLU = kernels.SILU):
        super().__init__(gate, up, down, glu)
        self.sigmoid_gate = sigmoid_gate

    def __call__(self, h: np.ndarray) -> np.ndarray:
        y = super().__call__(h)
        if self.sigmoid_gate is not None:
            y = kernels.sigmoid_gated(y, self.sigmoid_gate(h))
        return y


class Decoder:
    """Embeddings → layers → norm → logits, over a KV cache."""

    def __init__(self, layout: ModelLayout, store: ExpertStore, ctx: int):
        c = self.config = layout.config
        w = self.weights = Weights(layout)
        rope = Rope(c, ctx)
        ropes = {c.rope_theta: rope}  # a table per base: MiMo-V2-Flash's sliding layers have their own
        for theta in {c.rope_theta_of(i) for i in range(c.n_layers)} - {c.rope_theta}:
            ropes[theta] = Rope(dataclasses.replace(c, rope_theta=theta), ctx)
        index_rope = Rope(dataclasses.replace(c, rope_interleaved=c.index_rope_interleaved), ctx) if c.index_topk else None
        self.embed = w.linear("token_embd.weight")
        self.output = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight")
        self.output_norm = w.vector("output_norm.weight")
        self.route_log = None  # called as route_log(layer, positions, expert ids, weights) after each MoE layer
        self.records = [describe_layer(c, w, i, ropes[c.rope_theta_of(i)], store) for i in range(c.n_layers)]
        compress_rope = Rope(dataclasses.replace(c, rope_theta=c.compress_rope_theta, rope_scaling=c.compress_rope_scaling),
                             ctx) if c.attention == "compressed" else None
        self.layers = []  # (attention norm, token mixer, FFN norm, FFN) of each layer, for the prompt path
        self.expansion_budget = ExpansionBudget(EXPANDED_MLA_KEEP_BYTES)  # MLA's kept prompt expansions, all layers'
        for record in self.records:
            i, m = record.layer, record.matrices
            if c.is_linear_layer(i):
                attention = mixer_for(c, w, i)
            elif c.attention == "compressed":
                attention = CompressedAttention(c, w, i, rope, compress_rope)
            elif c.attention == "mla":
                attention = LatentAttention(c, w, record, self.expansion_budget, index_rope)
            else:
                indexer = BlockIndexer(c, w, i, ropes[c.rope_theta_of(i)]) if i in c.index_layers else None
                attention = Attention(c, record, indexer)
            if isinstance(attention, LatentAttention) and c.index_topk and attention.indexer is None:
                attention.shares = next(a for _, a, _, _ in reversed(self.layers)  # the last indexer's choice
                                        if isinstance(a, LatentAttention) and a.indexer is not None)
            router = HashRouter(c, record, w) if i in c.hash_layers else None
            ffn = MoE(c, record, store, router) if record.router is not None else \
                DenseFFN(m["ffn_gate"], m["ffn_up"], m["ffn_down"], record.ffn.glu)
            self.layers.append((record.attn_norm, attention, record.output.ffn_norm, ffn))
        # each layer's (attention's, FFN's) hyper-connection weights, then the head's
        self.hyper = [tuple(self.hyper_weights(f"blk.{i}.hc_{site}_") for site in ("attn", "ffn"))
                      for i in range(c.n_layers)] if c.hyper_streams else []
        self.hyper_head = self.hyper_weights("output_hc_") if c.hyper_streams and not c.hyper_head_mean else None
        self.mixing = hyper_connections.Mixing(c.hyper_sinkhorn_iters, np.float32(c.hyper_eps), np.float32(c.norm_eps)) \
            if c.hyper_streams else None
        self.decode_layers = self.fused_steps()
        moe = [(ffn, ffn_norm) for _, _, ffn_norm, ffn in self.layers if isinstance(ffn, MoE) and not c.hyper_streams]
        for (this, this_norm), (following, following_norm) in zip(moe, moe[1:]):
            ratio = np.divide(following_norm, this_norm, out=np.zeros_like(this_norm), where=this_norm != 0)
            this.lookahead = following, ratio

    def hyper_weights(self, prefix: str) -> hyper_connections.HyperWeights:
        w = self.weights
        return hyper_connections.HyperWeights(w.linear(prefix + "fn.weight"), w.vector(prefix + "base.weight"),
                                              w.vector(prefix + "scale.weight"))

    def fused_steps(self) -> list:
        """Each layer's decode step (a decoded token through it in a few numba calls), built on
        its record; None where a decoded token takes the prompt path (a hyper-connected layer
        without routed experts)."""
        c, steps = self.config, []
        for record, (_, mixer, _, ffn) in zip(self.records, self.layers):
            if c.hyper_streams:
                steps.append(fused.HyperDecodeLayer(c, record, mixer, ffn, self.hyper[record.layer], self.mixing)
                             if isinstance(ffn, MoE) else None)
            elif isinstance(mixer, Attention):
                steps.append(fused.DecodeLayer(c, record, mixer, ffn))
            else:  # MLA's sparse attention choice and a DeltaNet's mixer are the prompt path's own
                layer = fused.LatentDecodeLayer if isinstance(mixer, LatentAttention) else fused.DeltaNetDecodeLayer
                steps.append(layer(c, record, mixer, ffn))
        return steps

    @staticmethod
    def resident_bytes(layout: ModelLayout) -> int:
        """RAM of the resident weights: the stored tensors plus what is derived at load
        (MLA's absorbed keys, at most 4 bytes a value)."""
        c = layout.config
        derived = 4 * c.n_layers * c.n_heads * c.kv_lora_rank * c.qk_nope_head_dim if c.attention == "mla" else 0
        if c.hash_layers:  # each hash layer's table, as int64
            derived += 8 * len(c.hash_layers) * c.vocab_size * c.n_experts_used
        return sum(t.nbytes for t in layout.tensors.values()) + derived

    @staticmethod
    def cache_shape_for(c: ModelConfig) -> CacheShape:
        """What one sequence's cache holds: the KV streams' widths a position, the positions each
        layer's queries see (0: all), a DeltaNet layer's states; DeepSeek-V4's own streams and entries."""
        if c.attention == "compressed":
            return compressed_cache_shape(c)
        if c.attention == "mla" and c.index_kpool:
            return pooled_index_cache_shape(c)
        if c.attention == "mla":  # the latent, then the shared rotary key; the indexer's keys
            widths = {"kv": c.kv_lora_rank + c.qk_rope_head_dim, **({"index_k": c.index_head_dim} if c.index_topk else {})}
        else:
            widths = {"k": c.n_kv_heads * c.head_dim, "v": c.n_kv_heads * c.v_head_dim}
        own = tuple({"k": c.kv_heads_of(i) * c.head_dim, "v": c.kv_heads_of(i) * c.v_head_dim,
                     **({"index_k": c.index_head_dim} if i in c.index_layers else {})}
                    for i in range(c.n_layers)) if c.sliding_kv_heads or c.index_block else ()  # sliding layers'
        # own KV heads; the index keys of the layers with an indexer of blocks
        return CacheShape(c.n_layers, widths, tuple(c.window_of(layer) for layer in range(c.n_layers)),
                          tuple(GatedDeltaNet.state_shapes(c) if c.is_linear_layer(layer) else {}
                                for layer in range(c.n_layers)), layer_widths=own)

    def forward(self, tokens, cache: KVCache, all_logits: bool = True) -> np.ndarray:
        """Logits [n, vocab] for `tokens` placed after the cache's contents ([1, vocab] for the
        last token only, unless `all_logits`); one token takes the fused decode path, and its
        products the row dots of a token decoded alone (`kernels.decoding_alone`)."""
        with kernels.decoding_alone() if len(tokens) == 1 else contextlib.nullcontext():
            x = self.hidden_states(tokens, [Segment(0, len(tokens), cache.length, cache)], batch_invariant=False)
            return self.logits(x if all_logits else x[-1:])

    def forward_batch(self, batch: list[tuple[list[int], KVCache]], rows: list[int] | None = None) -> np.ndarray:
        """Logits [len(batch), vocab] of the last token of each (tokens, cache) pair, the tokens
        placed after that cache's contents, all sequences through each layer together; or of
        the tokens `rows` (places in the batch's tokens, in order). Every row is computed as it
        would be in a batch of its own (the int8 path, the many-row expert kernel, attention
        over its own cache), so a sequence gets the same bits with any company."""
        tokens, segments, first = [], [], 0
        for ids, cache in batch:
            segments.append(Segment(first, len(ids), cache.length, cache))
            tokens += ids
            first += len(ids)
        with kernels.without_amx():
            x = self.hidden_states(tokens, segments, batch_invariant=True)
            if rows is not None and not rows:
                return np.zeros((0, self.config.vocab_size), np.float32)
            return self.logits(x[[s.first + s.count - 1 for s in segments] if rows is None else rows])

    def hidden_states(self, tokens, segments: list[Segment], batch_invariant: bool) -> np.ndarray:
        """The last layer's output [len(tokens), hidden]; each segment's tokens are appended to its cache."""
        c = self.config
        for s in segments:
            s.cache.check_room(s.start, s.count)
        positions = np.concatenate([np.arange(s.start, s.end) for s in segments])
        x = np.concatenate([self.embed.rows_f32(int(t), 1) for t in tokens])
        if c.hyper_streams:
            x = self.hyper_layers(x, tokens, positions, segments, batch_invariant)
        else:
            x = self.residual_layers(x, positions, segments, batch_invariant)
        for s in segments:
            s.cache.length = s.end
        return x

    def residual_layers(self, x: np.ndarray, positions: np.ndarray, segments: list[Segment],
                        batch_invariant: bool) -> np.ndarray:
        """The layers over one residual stream; one token alone takes the fused decode steps."""
        fused = x.shape[0] == 1 and not batch_invariant
        for layer in range(self.config.n_layers):
            step = self.decode_layers[layer] if fused else None
            if step is not None:
                x = step(x, segments[0].start, segments[0].cache)
                self.log_route(layer, positions)
            else:
                x = self.feed(layer, self.mix(layer, x, positions, segments), None, positions, batch_invariant)
        return x

    def hyper_layers(self, x: np.ndarray, tokens, positions: np.ndarray, segments: list[Segment],
                     batch_invariant: bool) -> np.ndarray:
        """The layers over `hyper_streams` residual streams (DeepSeek-V4's mHC,
        `runtime.hyper_connections`), then the head's collapse of them: [n, hidden]."""
        streams = self.hyper_streams(x)
        fused = x.shape[0] == 1 and not batch_invariant
        for layer in range(self.config.n_layers):
            step = self.decode_layers[layer] if fused else None
            if step is not None:
                streams = step(streams, tokens[0], positions, segments)
                self.log_route(layer, positions)
            else:
                streams = self.feed(layer, self.mix(layer, streams, positions, segments), tokens, positions,
                                    batch_invariant)
        return self.hyper_collapse(streams)

    def hyper_streams(self, x: np.ndarray) -> np.ndarray:
        """Embeddings [n, hidden] as the `hyper_streams` copies the first layer reads."""
        return np.repeat(x[:, None, :], self.config.hyper_streams, axis=1)

    def hyper_collapse(self, streams: np.ndarray) -> np.ndarray:
        """The head's collapse of the last layer's streams: [n, hidden]."""
        if self.hyper_head is None:  # GLM-5-Next's: the plain mean
            return streams.mean(axis=1, dtype=np.float32)
        return hyper_connections.head(streams, self.hyper_head, self.mixing)

    def mix(self, layer: int, x: np.ndarray, positions: np.ndarray, segments: list[Segment]) -> np.ndarray:
        """Layer `layer`'s token mixer (attention, or a DeltaNet) over x with its residual or
        hyper-connection around it; each segment's rows go into its cache at this layer."""
        c = self.config
        attn_norm, attention, _, _ = self.layers[layer]
        if not c.hyper_streams:
            return x + attention(rms_norm(x, attn_norm, c.norm_eps), positions, segments)
        h, post, comb = hyper_connections.mix(x, self.hyper[layer][0], self.mixing)
        return hyper_connections.merge(x, attention(rms_norm(h, attn_norm, c.norm_eps), positions, segments), post, comb)

    def feed(self, layer: int, x: np.ndarray, tokens, positions: np.ndarray, batch_invariant: bool,
             out: np.ndarray | None = None) -> np.ndarray:
        """Layer `layer`'s FFN over x with its residual or hyper-connection around it (`tokens`, the
        rows' token ids, for a hash layer's router). With `batch_invariant`, a row gets the same
        bits in any company of rows. The residual's sum is written into x (the caller's to give
        up), and a MoE's output into `out` (float32 [n, hidden]) when given: a prompt pass's
        layers reuse one array, where each would fault in fresh pages."""
        c = self.config
        _, _, ffn_norm, ffn = self.layers[layer]
        if c.hyper_streams:
            h, post, comb = hyper_connections.mix(x, self.hyper[layer][1], self.mixing)
        else:
            h = x
        h = rms_norm(h, ffn_norm, c.norm_eps)
        y = ffn(h, batch_invariant, tokens, out) if isinstance(ffn, MoE) else ffn(h)
        self.log_route(layer, positions)
        return hyper_connections.merge(x, y, post, comb) if c.hyper_streams else np.add(x, y, out=x)

    def log_route(self, layer: int, positions: np.ndarray) -> None:
        ffn = self.layers[layer][3]
        if self.route_log is not None and isinstance(ffn, MoE):
            self.route_log(layer, positions, *ffn.last_route)

    def distinct_experts(self) -> int:
        """Distinct experts the last forward pass used, summed over the MoE layers."""
        return sum(ffn.last_distinct for *_, ffn in self.layers if isinstance(ffn, MoE))

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.output(rms_norm(x, self.output_norm, self.config.norm_eps))


def compressed_cache_shape(c: ModelConfig) -> CacheShape:
    """DeepSeek-V4's cache: in every layer a window of the key-value head and of its compressors'
    per-position projections (kv and gate), and the entries made so far. A layer keeps the
    positions its queries see, or those an entry pools (CSA: two windows of 4) if more."""
    widths, windows, entries = [], [], []
    for layer, ratio in enumerate(c.compress_ratios):
        streams, made, pooled = {"kv": c.head_dim}, {}, 0
        if ratio:
            overlap = 2 if ratio == OVERLAPPING_RATIO else 1
            streams.update(comp_kv=overlap * c.head_dim, comp_gate=overlap * c.head_dim)
            made["comp"], pooled = (ratio, c.head_dim), overlap * ratio
        if layer in c.index_layers:
            streams.update(index_kv=2 * c.index_head_dim, index_gate=2 * c.index_head_dim)
            made["index"] = (OVERLAPPING_RATIO, c.index_head_dim)
        widths.append(streams)
        windows.append(max(c.sliding_window, pooled))
        entries.append(made)
    return CacheShape(c.n_layers, {}, tuple(windows), layer_widths=tuple(widths), entries=tuple(entries))


def pooled_index_cache_shape(c: ModelConfig) -> CacheShape:
    """GLM-5-Next's cache: an MLA layer's latents; an indexer layer's index key and gate a
    position, and its pools' keys (entries); a linear layer's states."""
    widths, entries, states = [], [], []
    for layer in range(c.n_layers):
        indexed = layer in c.index_layers
        widths.append({"kv": c.kv_lora_rank + c.qk_rope_head_dim, **({"index_k": 2 * c.index_head_dim} if indexed else {})})
        entries.append({"index": (c.index_kpool, c.index_head_dim)} if indexed else {})
        states.append(GatedDeltaNet.state_shapes(c) if c.is_linear_layer(layer) else {})
    return CacheShape(c.n_layers, {}, states=tuple(states), layer_widths=tuple(widths), entries=tuple(entries))
