"""A decoded token through a layer in a few numba calls, not a few dozen.

A decoded token runs each layer's projections, router and experts on one activation vector.
Called one at a time from Python, with the norms, bias, clip, rotary, attention, residual and
top-k steps between them, every step of a layer is a numba or numpy call of its own. The steps
here take the layer's `LayerRecord` (runtime/layer_record.py), the same one the prompt path
runs on, and scratch arrays made once per layer (`DecodeLayer` for GQA, `LatentDecodeLayer`
for MLA, `DeltaNetDecodeLayer` for a gated DeltaNet; a routed MoE or a dense FFN after each):

1. one call for the attention norm and the projections into what attention takes: q, k, v
   and then `layer_steps.finish_qkv`, as the prompt path (`_qkv_kernel`); for MLA q_a / kv_a,
   their norms, q_b, the rotation and the query absorbed into the latent space
   (`_latent_query_kernel`);
2. the KV cache write and the attention (`kernels.attention_into`, as the general path), and
   an output gate's product (a DeltaNet layer: its whole mixer, `GatedDeltaNet.mixed`);
3. one call for the rest of the layer: the output projection (MLA: each head's slice of kv_b
   first), the residual, the FFN norm and then the FFN and its residual. A dense FFN runs
   there always (`_dense_tail_kernel`); before routed experts, the router and its top-k
   choice, then the experts themselves when every one is in the expert cache, found through
   the store's slot table and read in place, with an ungated shared expert
   (`_routed_tail_kernel`). When one is not cached (or the store is busy reading ahead), the
   call stops after the router (`_output_kernel`), and the experts go through `MoE.routed`
   (which reads them), a shared expert through `FFNStep`.

A kernel takes at most 8 parameters: the record's parts and their scratch are named tuples.
Numba's parallel regions take only flat ones (arrays and scalars, no tuple inside), so each
region is a function of its own (`_product`, `_products_of_two`, `_products_of_three`,
`_products_per_head`) called with the record's `Product`s and the activations.
A hyper-connected layer (DeepSeek-V4's) has streams, not one residual: `HyperDecodeLayer`
mixes them for the attention in one call, runs the prompt path's attention, and then merges,
mixes, routes (a hash layer: its table's experts, the router's weights) and runs the cached
experts in one more (`_hyper_tail_kernel`), with `runtime.hyper_connections`' own kernels.

The prompt path and these steps give the same bits (tests/test_fused.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba import prange

from colibri.runtime import kernels
from colibri.runtime.hyper_connections import Mixing, merge_into, mixing_into, normalized_into
from colibri.runtime.kernels.activations import fill_activation
from colibri.runtime.kernels.attention import Seen
from colibri.runtime.kernels.direct_call import DirectCall
from colibri.runtime.kernels.experts import Choice, glu_rows, moe_steps
from colibri.runtime.kernels.numerics import rms_norm_into
from colibri.runtime.kernels.routing import route_into, weigh_chosen_into
from colibri.runtime.kernels.rows import Product, rows_per_head, rows_times
from colibri.runtime.kernels.threads import part_range, thread_count
from colibri.runtime.layer_record import FFNWeights, LayerRecord
from colibri.runtime.layer_steps import finish_qkv
from colibri.runtime.rope import rotate_into

F32 = np.float32
NO_EXPERTS = np.empty(0, np.int64)  # no slot table; no hash layer's choice
SERIAL_BYTES = 128 << 10  # a decoded token's product of fewer weight bytes runs on the calling thread alone
_njit = numba.njit(cache=True, nogil=True)
_parallel = numba.njit(cache=True, nogil=True, parallel=True)


class QKV(NamedTuple):
    """A token's q, k and v [1, rows] as their products write them."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


class QKVScratch(NamedTuple):
    """`_qkv_kernel`'s buffers: the normed x `h`, its activation for each of q, k, v (k's and
    v's their own only when distinct from the ones before), the products, the position."""

    h: np.ndarray
    q_act: object
    k_act: object
    v_act: object
    k_distinct: bool
    v_distinct: bool
    out: QKV
    positions: np.ndarray


class LatentScratch(NamedTuple):
    """`_latent_query_kernel`'s buffers: the normed x `h`, `first`'s and kv_a's activations and
    products, the query (`first_out` itself without a LoRA), the latent and rotated parts, and
    what it writes: the queries [1, heads, rank + rope] and the cache entry [1, rank + rope]."""

    h: np.ndarray
    positions: np.ndarray
    first_act: object
    first_out: np.ndarray
    kv_act: object
    kv_distinct: bool
    compressed: np.ndarray
    q: np.ndarray
    latent: np.ndarray
    k_pe: np.ndarray
    q_pe: np.ndarray
    q_nope: np.ndarray
    absorb_act: object
    q_latent: np.ndarray
    queries: np.ndarray
    stored: np.ndarray


class LoRAScratch(NamedTuple):
    """The query LoRA's normed q_a output and its activation for q_b."""

    q_low: np.ndarray
    q_b_act: object


class OutputScratch(NamedTuple):
    """What attention writes [1, heads, width], its activation for o, o's output, and h: the
    FFN norm of the residual."""

    attended: np.ndarray
    o_act: object
    o_out: np.ndarray
    h: np.ndarray


class HeadsScratch(NamedTuple):
    """MLA: each head's attention context [heads, rank] and its activation for kv_b."""

    contexts: np.ndarray
    act: object


class RouteScratch(NamedTuple):
    """The router's activation of h, its logits, and its choice (ids, weights [1, k])."""

    act: object
    logits: np.ndarray
    ids: np.ndarray
    weights: np.ndarray


class FFNScratch(NamedTuple):
    """An FFN's activations (up's its own only when `up_distinct`), products and output."""

    gate_act: object
    up_act: object
    up_distinct: bool
    gate_out: np.ndarray
    up_out: np.ndarray
    down_act: object
    out: np.ndarray


class MoEDecode(NamedTuple):
    """A routed layer's tail: the router and its scratch, the experts' rule, their records
    (the store's slots), their scratch, the slots of the chosen, and their sum [hidden]."""

    router: object
    route: RouteScratch
    rule: object
    records: np.ndarray
    experts: object
    slots: np.ndarray
    routed: np.ndarray


@_njit
def _add(values, bias):
    for i in range(values.size):
        values[i] += bias[i]


@_njit
def _share_of_one(t, nthreads, matrix, act, out):
    """Thread t's contiguous share of the rows of one product."""
    lo, hi = part_range(out.shape[1], nthreads, t, 1)
    rows_times(matrix.tag, matrix.data, lo, hi, matrix.row_nbytes, matrix.cols, act, out)


@_njit
def _share_of_two(t, nthreads, a, a_act, a_out, b, b_act, b_out):
    """Thread t's share of two products of one input: its contiguous range of a's rows, then
    of b's (each product cut on its own, so that matrices of unlike encodings share out evenly)."""
    _share_of_one(t, nthreads, a, a_act, a_out)
    _share_of_one(t, nthreads, b, b_act, b_out)


@_parallel
def _product(matrix, act, out, nthreads):
    """out = the product of one row: on all threads, or, when its weights take fewer than
    SERIAL_BYTES, on this one (a parallel region costs more than the other threads would
    save). The rows are the same either way."""
    if out.shape[1] * matrix.row_nbytes < SERIAL_BYTES:
        _share_of_one(0, 1, matrix, act, out)
    else:
        for t in prange(nthreads):
            _share_of_one(t, nthreads, matrix, act, out)


@_parallel
def _products_of_two(a, a_act, a_out, b, b_act, b_out, nthreads):
    """`_share_of_two` on all threads, or on this one below SERIAL_BYTES in all."""
    if a_out.shape[1] * a.row_nbytes + b_out.shape[1] * b.row_nbytes < SERIAL_BYTES:
        _share_of_two(0, 1, a, a_act, a_out, b, b_act, b_out)
    else:
        for t in prange(nthreads):
            _share_of_two(t, nthreads, a, a_act, a_out, b, b_act, b_out)


@_parallel
def _products_of_three(q, k, v, q_act, k_act, v_act, out, nthreads):
    """out.q, out.k, out.v = the products of one row in one parallel region: each thread takes
    its share of the rows of q, of k and of v in turn (each product cut on its own, so that
    matrices of unlike encodings share out evenly)."""
    for t in prange(nthreads):
        _share_of_one(t, nthreads, q, q_act, out.q)
        _share_of_one(t, nthreads, k, k_act, out.k)
        _share_of_one(t, nthreads, v, v_act, out.v)


@_parallel
def _products_per_head(matrix, act, heads, stride, first, out, nthreads):
    """`rows_per_head` on all threads, or on this one below SERIAL_BYTES in all."""
    if heads * out.shape[2] * matrix.row_nbytes < SERIAL_BYTES:
        rows_per_head(0, 1, matrix, act, heads, stride, first, out)
    else:
        for t in prange(nthreads):
            rows_per_head(t, nthreads, matrix, act, heads, stride, first, out)


@_njit
def _qkv_kernel(x, rec, s, nthreads):
    """A GQA layer's q, k, v of x [1, hidden] into s.out (its `GQAInput` `rec`)."""
    rms_norm_into(x, rec.norm, rec.eps, s.h)
    cols = s.h.shape[1]
    fill_activation(s.q_act, s.h, 0, cols)
    if s.k_distinct:
        fill_activation(s.k_act, s.h, 0, cols)
    if s.v_distinct:
        fill_activation(s.v_act, s.h, 0, cols)
    _products_of_three(rec.q, rec.k, rec.v, s.q_act, s.k_act, s.v_act, s.out, nthreads)
    finish_qkv(rec, s.out.q, s.out.k, s.out.v, s.positions)


@_njit
def _latent_query_kernel(x, rec, s, lora, lora_s, nthreads):
    """MLA's queries s.queries and cache entry s.stored of x [1, hidden] (its `LatentInput`
    `rec`; `lora`, a `QueryLoRA`, with its scratch, or None)."""
    rms_norm_into(x, rec.norm, rec.eps, s.h)
    cols = s.h.shape[1]
    fill_activation(s.first_act, s.h, 0, cols)
    if s.kv_distinct:
        fill_activation(s.kv_act, s.h, 0, cols)
    _products_of_two(rec.first, s.first_act, s.first_out, rec.kv_a, s.kv_act, s.compressed, nthreads)
    if lora is not None:
        rms_norm_into(s.first_out, lora.q_a_norm, rec.latent_eps, lora_s.q_low)
        fill_activation(lora_s.q_b_act, lora_s.q_low, 0, lora_s.q_low.shape[1])
        _product(lora.q_b, lora_s.q_b_act, s.q, nthreads)
    heads, rank, nope = rec.heads, rec.rank, rec.nope
    rms_norm_into(np.ascontiguousarray(s.compressed[:, :rank]), rec.kv_a_norm, rec.latent_eps, s.latent)
    rotate_into(np.ascontiguousarray(s.compressed[:, rank:]).reshape(1, 1, -1), rec.rope, s.positions, s.k_pe)
    q_heads = s.q.reshape(1, heads, -1)
    rotate_into(q_heads[:, :, nope:], rec.rope, s.positions, s.q_pe)
    s.q_nope[:, :] = q_heads[0, :, :nope]
    fill_activation(s.absorb_act, s.q_nope, 0, s.q_nope.size)
    _products_per_head(rec.absorb, s.absorb_act, heads, rank, 0, s.q_latent.reshape(heads, 1, rank), nthreads)
    s.queries[0, :, :rank] = s.q_latent
    s.queries[0, :, rank:] = s.q_pe[0]
    s.stored[0, :rank] = s.latent[0]
    s.stored[0, rank:] = s.k_pe[0, 0]


@_njit
def _output_steps(x, rec, s, heads, nthreads):
    """x += o(s.attended) (+ o_bias, unless empty); s.h = the FFN norm of x. With `heads`
    (MLA: a `PerHead` and its `HeadsScratch`), s.attended is first each head's context times
    its slice of kv_b."""
    if heads is not None:
        per_head, hs = heads
        fill_activation(hs.act, hs.contexts, 0, hs.contexts.size)
        n = s.attended.shape[1]
        _products_per_head(per_head.kv_b, hs.act, n, per_head.stride, per_head.first, s.attended.reshape(n, 1, -1),
                           nthreads)
    flat = s.attended.reshape(1, -1)
    fill_activation(s.o_act, flat, 0, flat.shape[1])
    _product(rec.o, s.o_act, s.o_out, nthreads)
    if rec.o_bias.size:
        _add(s.o_out[0], rec.o_bias)
    for i in range(x.shape[1]):
        x[0, i] += s.o_out[0, i]
    rms_norm_into(x, rec.ffn_norm, rec.eps, s.h)


@_njit
def _route_steps(h, router, rs, nthreads):
    """The router's choice (rs.ids, rs.weights) for h [1, hidden]: its logits (+ logit_bias,
    unless empty), then `route_into`."""
    fill_activation(rs.act, h, 0, h.shape[1])
    _product(router.gate, rs.act, rs.logits, nthreads)
    if router.logit_bias.size:
        _add(rs.logits[0], router.logit_bias)
    route_into(rs.logits, router.bias, router.rule, rs.ids, rs.weights)


@_njit
def _ffn_steps(h, ffn, fs, nthreads):
    """fs.out = down(glu(gate(h), up(h))) for h [1, hidden] (`ffn`: `FFNWeights`), as
    `kernels.glu_times` computes it."""
    fill_activation(fs.gate_act, h, 0, h.shape[1])
    if fs.up_distinct:
        fill_activation(fs.up_act, h, 0, h.shape[1])
    _products_of_two(ffn.gate, fs.gate_act, fs.gate_out, ffn.up, fs.up_act, fs.up_out, nthreads)
    glu_rows(fs.gate_out, fs.up_out, 0, 1, ffn.glu.kind, ffn.glu.alpha, ffn.glu.limit)
    fill_activation(fs.down_act, fs.gate_out, 0, fs.gate_out.shape[1])
    _product(ffn.down, fs.down_act, fs.out, nthreads)


@_njit
def _output_kernel(x, rec, s, heads, router, rs, nthreads):
    """`_output_steps`, then the router's choice for s.h (`_route_steps`)."""
    _output_steps(x, rec, s, heads, nthreads)
    _route_steps(s.h, router, rs, nthreads)


@_njit
def _cached_experts_steps(h, moe, shared, table, nthreads):
    """moe.routed = the experts moe.route chose for h [1, hidden], read in place from their
    cache slots in `table` (each expert's row of `moe.records`, -1 for none) (`moe_steps`), plus
    `shared` (an ungated shared expert's weights and scratch, or None). False, and nothing
    computed, when one has no slot."""
    ids, biased_rows = moe.route.ids, moe.rule.gate_bias.shape[0]
    for j in range(moe.slots.size):
        expert = ids[0, j]
        if expert < 0 or expert >= table.size or table[expert] < 0 or table[expert] >= moe.records.shape[0] or \
                (biased_rows and expert >= biased_rows):
            return False
        moe.slots[j] = table[expert]
    moe_steps(moe.rule, moe.records, Choice(moe.slots, ids[0], moe.route.weights[0]), moe.experts, h, moe.routed,
              nthreads)
    if shared is not None:
        weights, fs = shared
        _ffn_steps(h, weights, fs, nthreads)
        for i in range(moe.routed.size):
            moe.routed[i] += fs.out[0, i]
    return True


@_njit
def _routed_tail_kernel(x, rec, s, heads, moe, shared, table, nthreads):
    """`_output_kernel`, then, when every chosen expert has a cache slot in `table`, the
    experts and `shared` (`_cached_experts_steps`) and the residual: x += routed (+ shared).
    False when one has none: x holds the attention output and s.h, moe.route the router's
    choice, the experts still to run."""
    _output_kernel(x, rec, s, heads, moe.router, moe.route, nthreads)
    if not _cached_experts_steps(s.h, moe, shared, table, nthreads):
        return False
    for i in range(moe.routed.size):
        x[0, i] += moe.routed[i]
    return True


@_njit
def _dense_tail_kernel(x, rec, s, heads, ffn, fs, nthreads):
    """`_output_steps`, then a dense FFN (`_ffn_steps`) and the residual: x += its output."""
    _output_steps(x, rec, s, heads, nthreads)
    _ffn_steps(s.h, ffn, fs, nthreads)
    for i in range(fs.out.shape[1]):
        x[0, i] += fs.out[0, i]


def _activation_for(matrix: kernels.Matrix, values: np.ndarray):
    """The activation buffer `matrix` multiplies `values` [n, cols] through: `values` itself on
    the float path, else an int8 activation with float lanes the kernels fill from it."""
    return values if matrix.dot_type is None else matrix.empty_activation(values.shape[0], lanes=True)


def ffn_scratch(gate: kernels.Matrix, up: kernels.Matrix, down: kernels.Matrix, h: np.ndarray) -> FFNScratch:
    """An FFN's scratch for the row h [1, hidden] it reads."""
    gate_out, up_out = (np.empty((1, m.rows), F32) for m in (gate, up))
    gate_act = _activation_for(gate, h)
    same = up.dot_type == gate.dot_type
    return FFNScratch(gate_act, gate_act if same else _activation_for(up, h), not same, gate_out, up_out,
                      _activation_for(down, gate_out), np.empty((1, down.rows), F32))


class FFNStep:
    """down(glu(gate(h), up(h))) of one row in one call, for a dense FFN or an ungated shared
    expert (`glu`: a `kernels.GLU`); reads its input from `h` [1, hidden] when called."""

    def __init__(self, gate: kernels.Matrix, up: kernels.Matrix, down: kernels.Matrix, h: np.ndarray,
                 glu: kernels.GLU = kernels.SILU):
        self.h = h
        self.weights = FFNWeights(gate.product, up.product, down.product, glu)
        self.scratch = ffn_scratch(gate, up, down, h)

    def __call__(self) -> np.ndarray:
        """The FFN of the current `h` [1, hidden] (a buffer, overwritten by the next call)."""
        _ffn_steps(self.h, self.weights, self.scratch, thread_count())
        return self.scratch.out


def _ffn_parts(c, record: LayerRecord, ffn, h: np.ndarray):
    """(the dense FFN's or an ungated shared expert's `FFNStep`, or None; the routed experts'
    `MoEDecode`, or None) of a layer, reading their input from h [1, hidden]."""
    m, ffn_step, moe = record.matrices, None, None
    if record.ffn is not None and "shared_gate" not in m:
        ffn_step = FFNStep(m["ffn_gate"], m["ffn_up"], m["ffn_down"], h, record.ffn.glu)
    if record.router is not None:
        k = c.n_experts_used
        route = RouteScratch(_activation_for(m["router"], h), np.empty((1, m["router"].rows), F32),
                             np.empty((1, k), np.int64), np.empty((1, k), F32))
        experts = record.experts
        moe = MoEDecode(record.router, route, experts.rule, ffn.store.records(record.layer),
                        experts.scratch(h, k), np.empty(k, np.int64), np.empty(c.hidden_size, F32))
    return ffn_step, moe


class _LayerStep:
    """What the GQA, MLA and DeltaNet steps share: the output kernel after the token mixer, and
    the FFN (`ffn`: the prompt path's `model.MoE` or `model.DenseFFN`, whose `routed` reads
    experts that are not cached)."""

    def __init__(self, c, record: LayerRecord, ffn):
        self.c, self.record, self.ffn = c, record, ffn
        m = record.matrices
        self.h = np.empty((1, c.hidden_size), F32)
        self.positions = np.empty(1, np.int64)
        attended = np.empty((1, record.heads, record.width), F32)
        self.output = OutputScratch(attended, _activation_for(m["o"], attended.reshape(1, -1)),
                                    np.empty((1, c.hidden_size), F32), self.h)
        self.attended = attended
        self.heads = None  # MLA's kv_b per head (`LatentDecodeLayer`)
        self.ffn_step, self.moe = _ffn_parts(c, record, ffn, self.h)
        # the routed experts run in the output kernel's call when they are all cached (the
        # kernel looks them up in the store's slot table), with the shared expert unless it is
        # gated (Qwen2-MoE's: then the experts run after the output kernel)
        # (not Llama 4's, whose weight scales the expert's input: `model.MoE.routed` applies it)
        self.fuse_experts = self.moe is not None and (record.ffn is None or self.ffn_step is not None) \
            and not c.expert_input_scaled
        self.shared = None if self.ffn_step is None else (self.ffn_step.weights, self.ffn_step.scratch)
        # this layer's kernels, each typed once for its own record and scratch (kernels.direct_call)
        self.dense_tail, self.output_call, self.routed_tail = (DirectCall(k) for k in (
            _dense_tail_kernel, _output_kernel, _routed_tail_kernel))

    def finish(self, x: np.ndarray) -> np.ndarray:
        """x with the attention output in `attended` and then the FFN added (in place when the
        FFN runs in the output kernel's call)."""
        rec, ffn, nthreads = self.record.output, self.ffn, thread_count()
        if self.moe is None:
            self.dense_tail(x, rec, self.output, self.heads, self.ffn_step.weights, self.ffn_step.scratch, nthreads)
            return x
        table = ffn.store.slot_table(self.record.layer) if self.fuse_experts and ffn.observe is None else None
        route = self.moe.route
        if table is None:
            self.output_call(x, rec, self.output, self.heads, self.moe.router, route, nthreads)
        elif self.routed_tail(x, rec, self.output, self.heads, self.moe, self.shared, table, nthreads):
            ffn.ran_cached(route.ids, route.weights)
            return x
        out = ffn.routed(self.h, route.ids, route.weights)
        if ffn.shared is not None:
            out = out + (self.ffn_step() if self.ffn_step is not None else ffn.shared(self.h))
        return x + out


class DecodeLayer(_LayerStep):
    """One token through a GQA layer (`attention`: the prompt path's `model.Attention`, for an
    indexer's choice) and the FFN after it: x [1, hidden] -> the layer's output (x itself gets
    the attention output added)."""

    def __init__(self, c, record: LayerRecord, attention, ffn):
        super().__init__(c, record, ffn)
        self.attention = attention
        m = record.matrices
        qkv = (m["q"], m["k"], m["v"])
        out = QKV(*(np.empty((1, x.rows), F32) for x in qkv))
        shared = {}  # one activation per dot type, as Attention.project
        for x in qkv:
            shared.setdefault(x.dot_type, _activation_for(x, self.h))
        acts = tuple(shared[x.dot_type] for x in qkv)
        self.query = QKVScratch(self.h, *acts, acts[1] is not acts[0], acts[2] is not acts[0] and acts[2] is not acts[1],
                                out, self.positions)
        self.q = out.q.reshape(1, c.n_heads, c.head_dim)
        self.qkv = DirectCall(_qkv_kernel)

    def __call__(self, x: np.ndarray, position: int, cache) -> np.ndarray:
        c, record, layer = self.c, self.record, self.record.layer
        self.positions[0] = position
        self.qkv(x, record.mixer, self.query, thread_count())
        cache.write(layer, "k", position, self.query.out.k)
        cache.write(layer, "v", position, self.query.out.v)
        first = cache.first(layer, "k")
        heads = record.mixer.kv_heads
        keys = cache.stored(layer, "k", position + 1).reshape(position + 1 - first, heads, c.head_dim)
        values = cache.stored(layer, "v", position + 1).reshape(position + 1 - first, heads, c.v_head_dim)
        chosen = None
        if self.attention.indexer is not None:
            index_keys = self.attention.indexer.keys(self.h, self.positions)
            chosen = self.attention.choose(cache, self.h, self.positions, position, index_keys)
        # attention through the general path's own kernels: compiled inside another kernel, its
        # loops could be vectorized differently, and the two paths would part by a few ulps
        seen = Seen(position, first, record.window, kernels.NO_CHOICE if chosen is None else chosen, record.chunk,
                    c.index_block or 1)
        kernels.attention_into(self.q, keys, values, seen, record.scoring, self.attended)
        if "gate" in record.matrices:  # Qwen3-Next's output gate, as model.Attention applies it
            gate = record.matrices["gate"](self.h).reshape(self.attended.shape)
            self.attended[:] = kernels.sigmoid_gated(self.attended, gate)
        return self.finish(x)


class DeltaNetDecodeLayer(_LayerStep):
    """One token through a `deltanet.GatedDeltaNet` layer and the FFN after it: the mixer as the
    general path runs it, then the output kernel (ssm_out, the residual, the FFN norm and the
    router) and the FFN as the attention steps run them."""

    def __init__(self, c, record: LayerRecord, mixer, ffn):
        super().__init__(c, record, ffn)
        self.mixer = mixer

    def __call__(self, x: np.ndarray, position: int, cache) -> np.ndarray:
        rms_norm_into(x, self.record.attn_norm, F32(self.c.norm_eps), self.h)
        self.attended[:] = self.mixer.mixed(self.h, [(slice(0, 1), position, cache)]).reshape(self.attended.shape)
        return self.finish(x)


class LatentDecodeLayer(_LayerStep):
    """One token through an MLA layer (`attention`: the prompt path's `model.LatentAttention`,
    for DeepSeek's sparse attention choice) and the FFN after it: x [1, hidden] -> the layer's
    output (x itself gets the attention output added)."""

    def __init__(self, c, record: LayerRecord, attention, ffn):
        super().__init__(c, record, ffn)
        self.attention = attention
        m, rec = record.matrices, record.mixer
        heads, nope, rope, rank = rec.heads, rec.nope, c.qk_rope_head_dim, rec.rank
        first = m["q_a" if record.lora else "q"]
        first_act, first_out = _activation_for(first, self.h), np.empty((1, first.rows), F32)
        kv_distinct = m["kv_a"].dot_type != first.dot_type
        kv_act = _activation_for(m["kv_a"], self.h) if kv_distinct else first_act
        self.lora = None
        q = first_out
        if record.lora is not None:
            q_low = np.empty((1, first.rows), F32)
            self.lora = LoRAScratch(q_low, _activation_for(m["q_b"], q_low))
            q = np.empty((1, m["q_b"].rows), F32)
        q_nope = np.empty((heads, nope), F32)
        self.query = LatentScratch(self.h, self.positions, first_act, first_out, kv_act, kv_distinct,
                                   np.empty((1, rank + rope), F32), q, np.empty((1, rank), F32),
                                   np.empty((1, 1, rope), F32), np.empty((1, heads, rope), F32), q_nope,
                                   _activation_for(m["k_absorb"], q_nope), np.empty((heads, rank), F32),
                                   np.empty((1, heads, rank + rope), F32), np.empty((1, rank + rope), F32))
        contexts = np.empty((heads, rank), F32)
        self.contexts = contexts.reshape(1, heads, rank)
        self.heads = (record.per_head, HeadsScratch(contexts, _activation_for(m["kv_b"], contexts)))
        self.latent_query = DirectCall(_latent_query_kernel)

    def __call__(self, x: np.ndarray, position: int, cache) -> np.ndarray:
        c, record, s = self.c, self.record, self.query
        self.positions[0] = position
        self.latent_query(x, record.mixer, s, record.lora, self.lora, thread_count())
        cache.forget_expansion(record.layer)  # (a decoded token: the prompt's expanded cuts are over)
        cache.write(record.layer, "kv", position, s.stored)
        keys = cache.stored(record.layer, "kv", position + 1)[:, None, :]
        q_low = s.first_out if self.lora is None else self.lora.q_low
        chosen = self.attention.choose(cache, q_low, self.h, self.positions, position) if c.index_topk else None
        # attention through the general path's own kernels (see DecodeLayer)
        chosen = kernels.NO_CHOICE if chosen is None else np.ascontiguousarray(chosen, dtype=np.uint8)
        kernels.attention_into(s.queries, keys, keys[:, :, :record.mixer.rank], Seen(position, 0, 0, chosen),
                               record.scoring, self.contexts)
        return self.finish(x)


class HyperSite(NamedTuple):
    """A hyper-connection mixing site as numba takes it: fn's `Product`, base and scale."""

    fn: Product
    base: np.ndarray
    scale: np.ndarray


class MixScratch(NamedTuple):
    """A mixing site's buffers for one token: the streams normalized and flattened [1, streams *
    hidden], their activation for fn, fn's output, and what `mixing_into` writes."""

    flat: np.ndarray
    act: object
    m: np.ndarray
    collapsed: np.ndarray
    post: np.ndarray
    comb: np.ndarray


class HyperDecode(NamedTuple):
    """A hyper-connected layer's mixing for one token: its attention's and its FFN's sites and
    scratch, the mixing's scalars, the attention and FFN norms and their epsilon, the block
    input h [1, hidden], and the streams [1, streams, hidden] after the attention (`merged`)
    and after the FFN (`out`)."""

    attention_site: HyperSite
    attention_mix: MixScratch
    ffn_site: HyperSite
    ffn_mix: MixScratch
    mixing: Mixing
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    eps: np.float32
    h: np.ndarray
    merged: np.ndarray
    out: np.ndarray


@_njit
def _mix_steps(streams, site, s, mixing, nthreads):
    """One site's mixing of the streams [1, streams, hidden] into s (`hyper_connections.mix`)."""
    normalized_into(streams.reshape(1, -1), mixing.norm_eps, s.flat)
    fill_activation(s.act, s.flat, 0, s.flat.shape[1])
    _product(site.fn, s.act, s.m, nthreads)
    mixing_into(s.m, site.base, site.scale, streams, mixing, s.collapsed, s.post, s.comb)


@_njit
def _hyper_input_kernel(streams, hd, nthreads):
    """The attention's input hd.h of the streams [1, streams, hidden]: their mixing, then the
    attention norm."""
    _mix_steps(streams, hd.attention_site, hd.attention_mix, hd.mixing, nthreads)
    rms_norm_into(hd.attention_mix.collapsed, hd.attn_norm, hd.eps, hd.h)


@_njit
def _hyper_tail_kernel(streams, y, hd, moe, shared, table, chosen, nthreads):
    """The attention output y [1, hidden] merged into the streams (hd.merged), the FFN's mixing
    and norm (hd.h), the router's weights of the experts `chosen` (a hash layer's row of its
    table; empty: the router's own choice), and, when every chosen expert has a cache slot in
    `table`, the experts and `shared` (`_cached_experts_steps`) merged into hd.out. False when
    one has none: the choice in moe.route, the experts still to run."""
    merge_into(streams, y, hd.attention_mix.post, hd.attention_mix.comb, hd.merged)
    _mix_steps(hd.merged, hd.ffn_site, hd.ffn_mix, hd.mixing, nthreads)
    rms_norm_into(hd.ffn_mix.collapsed, hd.ffn_norm, hd.eps, hd.h)
    rs = moe.route
    if chosen.size:
        fill_activation(rs.act, hd.h, 0, hd.h.shape[1])
        _product(moe.router.gate, rs.act, rs.logits, nthreads)
        rs.ids[0, :] = chosen
        weigh_chosen_into(rs.logits, moe.router.rule, rs.ids, rs.weights)
    else:
        _route_steps(hd.h, moe.router, rs, nthreads)
    if not _cached_experts_steps(hd.h, moe, shared, table, nthreads):
        return False
    merge_into(hd.merged, moe.routed.reshape(1, -1), hd.ffn_mix.post, hd.ffn_mix.comb, hd.out)
    return True


def _site(w, streams: int, hidden: int) -> tuple[HyperSite, MixScratch]:
    """A mixing site's `HyperSite` from its `hyper_connections.HyperWeights`, and its scratch."""
    flat = np.empty((1, streams * hidden), F32)
    scratch = MixScratch(flat, _activation_for(w.fn, flat), np.empty((1, w.fn.rows), F32),
                         np.empty((1, hidden), F32), np.empty((1, streams), F32),
                         np.empty((1, streams, streams), F32))
    return HyperSite(w.fn.product, w.base, w.scale), scratch


class HyperDecodeLayer:
    """One token through a hyper-connected layer with routed experts (DeepSeek-V4's): streams
    [1, streams, hidden] -> the streams after it (a buffer of this step's, overwritten by its
    next call). Three calls: the attention's mixing and norm; the attention (`attention`: the
    prompt path's `CompressedAttention`, its window, entries and indexer its own); the merge,
    the FFN's mixing, norm and router, and, when every chosen expert is cached, the experts,
    the shared expert and the last merge (else `ffn.routed` reads them, as `_LayerStep.finish`)."""

    def __init__(self, c, record: LayerRecord, attention, ffn, sites, mixing: Mixing):
        self.record, self.attention, self.ffn = record, attention, ffn
        streams, hidden = c.hyper_streams, c.hidden_size
        h = np.empty((1, hidden), F32)
        attention_site, attention_mix = _site(sites[0], streams, hidden)
        ffn_site, ffn_mix = _site(sites[1], streams, hidden)
        self.hyper = HyperDecode(attention_site, attention_mix, ffn_site, ffn_mix, mixing, record.attn_norm,
                                 record.output.ffn_norm, record.output.eps, h,
                                 np.empty((1, streams, hidden), F32), np.empty((1, streams, hidden), F32))
        self.ffn_step, self.moe = _ffn_parts(c, record, ffn, h)
        self.hash_table = getattr(ffn.router, "table", None)  # a hash layer's token -> experts
        self.shared = None if self.ffn_step is None else (self.ffn_step.weights, self.ffn_step.scratch)
        self.input_call, self.tail = DirectCall(_hyper_input_kernel), DirectCall(_hyper_tail_kernel)

    def __call__(self, streams: np.ndarray, token: int, positions: np.ndarray, segments: list) -> np.ndarray:
        hd, ffn, nthreads = self.hyper, self.ffn, thread_count()
        self.input_call(streams, hd, nthreads)
        y = self.attention(hd.h, positions, segments)
        table = ffn.store.slot_table(self.record.layer) if ffn.observe is None else None
        chosen = NO_EXPERTS if self.hash_table is None else self.hash_table[token]
        route = self.moe.route
        if self.tail(streams, y, hd, self.moe, self.shared, NO_EXPERTS if table is None else table, chosen, nthreads):
            ffn.ran_cached(route.ids, route.weights)
            return hd.out
        out = ffn.routed(hd.h, route.ids, route.weights)
        if ffn.shared is not None:
            out = out + (self.ffn_step() if self.ffn_step is not None else ffn.shared(hd.h))
        merge_into(hd.merged, out, hd.ffn_mix.post, hd.ffn_mix.comb, hd.out)
        return hd.out
