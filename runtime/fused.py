"""A decoded token through a layer in a few numba calls, not a few dozen.

A decoded token runs each layer's projections, router and experts on one activation vector.
Called one at a time from Python, with the norms, bias, clip, rotary, attention, residual and
top-k steps between them, every step of a layer is a numba or numpy call of its own. The steps
here do the same work for every layer the decoder builds (GQA `DecodeLayer`, MLA
`LatentDecodeLayer`, a gated DeltaNet's `DeltaNetDecodeLayer`; a routed MoE or a dense FFN
after each):

1. one call for the attention norm and the projections into what attention takes: q, k, v
   with their bias, q/k norms, clip and rotation (`_qkv_kernel`); for MLA q_a / kv_a, their
   norms, q_b, the rotation and the query absorbed into the latent space (`_latent_query_kernel`);
2. the KV cache write and the attention (`kernels.attention`), as the general path, and an
   output gate's product (a DeltaNet layer: its whole mixer, `GatedDeltaNet.mixed`);
3. one call for the rest of the layer: the output projection (MLA: each head's slice of kv_b
   first), the residual, the FFN norm and then the FFN and its residual. A dense FFN runs
   there always (`_dense_tail_kernel`); before routed experts, the router and its top-k
   choice, then the experts themselves when every one is in the expert cache, found through
   the store's slot table and read in place, with an ungated shared expert
   (`_routed_tail_kernel`). When one is not cached (or the store is busy reading ahead), the
   call stops after the router, and the experts go through `MoE.routed` (which reads them),
   a shared expert through `FFNStep`.

All steps keep the arithmetic of `model.Attention`, `model.LatentAttention`, `model.Router` and
`model.DenseFFN`, which serve prompts, so both paths give the same bits (tests/test_fused.py).
Their scratch arrays are allocated once per layer.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from colibri.runtime import kernels
from colibri.runtime.kernels.activations import fill_activation
from colibri.runtime.kernels.experts import moe_steps, silu_times_rows
from colibri.runtime.kernels.numerics import rms_norm_into
from colibri.runtime.kernels.routing import route_into
from colibri.runtime.kernels.rows import rows_per_head, rows_times
from colibri.runtime.kernels.threads import part_range, thread_count
from colibri.runtime.rope import rotate_into

F32 = np.float32
QK_NORMS = {"none": 0, "full": 1, "head": 2}


@numba.njit(cache=True, nogil=True)
def _add(values, bias):
    for i in range(values.size):
        values[i] += bias[i]


@numba.njit(cache=True, nogil=True)
def _clip(values, limit):
    for i in range(values.size):
        values[i] = min(max(values[i], -limit), limit)


@numba.njit(cache=True, nogil=True)
def _fill_pair(h, a_act, b_act, b_distinct):
    """h [1, cols] quantized for two products of it: into a's activation, and into b's when
    it is not the same one."""
    fill_activation(a_act, h, 0, h.shape[1])
    if b_distinct:
        fill_activation(b_act, h, 0, h.shape[1])


@numba.njit(cache=True, nogil=True)
def _share_of_one(t, nthreads, matrix, act, out, cols):
    """Thread t's contiguous share of the rows of one product (matrix: (tag, weights, row bytes))."""
    tag, w, nbytes = matrix
    lo, hi = part_range(out.shape[1], nthreads, t, 1)
    rows_times(tag, w, lo, hi, nbytes, cols, act, out)


@numba.njit(cache=True, nogil=True)
def _share_of_two(t, nthreads, cols, a, a_act, a_out, b, b_act, b_out):
    """Thread t's share of two products of one input: the rows of a, then of b, cut into
    `nthreads` contiguous ranges (one memory stream per thread)."""
    a_tag, a_w, a_nbytes = a
    b_tag, b_w, b_nbytes = b
    a_rows = a_out.shape[1]
    lo, hi = part_range(a_rows + b_out.shape[1], nthreads, t, 1)
    if lo < a_rows:
        rows_times(a_tag, a_w, lo, min(hi, a_rows), a_nbytes, cols, a_act, a_out)
    if hi > a_rows:
        rows_times(b_tag, b_w, max(lo - a_rows, 0), hi - a_rows, b_nbytes, cols, b_act, b_out)


SERIAL_BYTES = 128 << 10  # a decoded token's product of fewer weight bytes runs on the calling thread alone


@numba.njit(cache=True, nogil=True, inline="always")
def _product(matrix, act, out, cols, nthreads):
    """out = the product of one row: on all threads, or, when its weights take fewer than
    SERIAL_BYTES, on this one (a parallel region costs more than the other threads would
    save). The rows are the same either way."""
    if out.shape[1] * matrix[2] < SERIAL_BYTES:
        _share_of_one(0, 1, matrix, act, out, cols)
    else:
        for t in prange(nthreads):
            _share_of_one(t, nthreads, matrix, act, out, cols)


@numba.njit(cache=True, nogil=True, inline="always")
def _products_of_two(cols, a, a_act, a_out, b, b_act, b_out, nthreads):
    """`_share_of_two` on all threads, or on this one below SERIAL_BYTES in all."""
    if a_out.shape[1] * a[2] + b_out.shape[1] * b[2] < SERIAL_BYTES:
        _share_of_two(0, 1, cols, a, a_act, a_out, b, b_act, b_out)
    else:
        for t in prange(nthreads):
            _share_of_two(t, nthreads, cols, a, a_act, a_out, b, b_act, b_out)


@numba.njit(cache=True, nogil=True, inline="always")
def _products_per_head(matrix, cols, act, heads, stride, first, out, nthreads):
    """`rows_per_head` on all threads, or on this one below SERIAL_BYTES in all."""
    tag, w, nbytes = matrix
    if heads * out.shape[2] * nbytes < SERIAL_BYTES:
        rows_per_head(0, 1, tag, w, nbytes, cols, act, heads, stride, first, out)
    else:
        for t in prange(nthreads):
            rows_per_head(t, nthreads, tag, w, nbytes, cols, act, heads, stride, first, out)


@numba.njit(cache=True, nogil=True, parallel=True)
def _qkv_kernel(x, attn_norm, eps, h, tags, weights, row_nbytes, q_act, k_act, v_act, distinct, outs, biases, norms,
                qk_norm, clip, cos, sin, positions, rope_dim, interleaved, heads, kv_heads, nthreads):
    # (the activations are arguments of their own: numba's parallel regions cannot take a
    # named tuple unpacked from a tuple; `distinct` says which of them is not an earlier one)
    q_tag, k_tag, v_tag = tags
    q_w, k_w, v_w = weights
    q, k, v = outs
    rms_norm_into(x, attn_norm, eps, h)
    cols = h.shape[1]
    fill_activation(q_act, h, 0, cols)
    if distinct[1]:
        fill_activation(k_act, h, 0, cols)
    if distinct[2]:
        fill_activation(v_act, h, 0, cols)
    q_rows, k_rows, v_rows = q.shape[1], k.shape[1], v.shape[1]
    # one parallel region over the rows of q, k and v in turn: each thread streams its share
    for t in prange(nthreads):
        lo, hi = part_range(q_rows + k_rows + v_rows, nthreads, t, 1)
        if lo < q_rows:
            rows_times(q_tag, q_w, lo, min(hi, q_rows), row_nbytes[0], cols, q_act, q)
        if lo < q_rows + k_rows and hi > q_rows:
            rows_times(k_tag, k_w, max(lo - q_rows, 0), min(hi - q_rows, k_rows), row_nbytes[1], cols, k_act, k)
        if hi > q_rows + k_rows:
            rows_times(v_tag, v_w, max(lo - q_rows - k_rows, 0), hi - q_rows - k_rows, row_nbytes[2], cols, v_act, v)
    if biases[0].size:
        _add(q[0], biases[0])
        _add(k[0], biases[1])
        _add(v[0], biases[2])
    if qk_norm == 1:
        rms_norm_into(q.copy(), norms[0], eps, q)
        rms_norm_into(k.copy(), norms[1], eps, k)
    if clip > 0:
        _clip(q[0], clip)
        _clip(k[0], clip)
        _clip(v[0], clip)
    q_heads, k_heads = q.reshape(1, heads, -1), k.reshape(1, kv_heads, -1)
    if qk_norm == 2:
        rms_norm_into(q_heads[0].copy(), norms[0], eps, q_heads[0])
        rms_norm_into(k_heads[0].copy(), norms[1], eps, k_heads[0])
    rotate_into(q_heads.copy(), cos, sin, positions, rope_dim, interleaved, q_heads)
    rotate_into(k_heads.copy(), cos, sin, positions, rope_dim, interleaved, k_heads)


@numba.njit(cache=True, nogil=True, parallel=True)
def _latent_query_kernel(x, attn_norm, eps, latent_eps, h, first, first_act, first_out, kv_a, kv_act, kv_distinct,
                         compressed, lora, q_a_norm, q_b, q_b_act, q_low, q, kv_a_norm, latent, cos, sin, positions,
                         rope_dim, interleaved, absorb, q_nope, absorb_act, q_latent, q_pe, k_pe, queries, stored,
                         nthreads):
    """MLA's queries [1, heads, rank + rope] and the cache entry `stored` [1, rank + rope] of x
    (the latent norms with `latent_eps`). `first` is q_a with a query LoRA (`lora`), else q
    itself (then `q` is `first_out` and the q_b arguments are not read)."""
    rms_norm_into(x, attn_norm, eps, h)
    cols = h.shape[1]
    _fill_pair(h, first_act, kv_act, kv_distinct)
    _products_of_two(cols, first, first_act, first_out, kv_a, kv_act, compressed, nthreads)
    if lora:
        rms_norm_into(first_out, q_a_norm, latent_eps, q_low)
        fill_activation(q_b_act, q_low, 0, q_low.shape[1])
        _product(q_b, q_b_act, q, q_low.shape[1], nthreads)
    heads, rank = q_latent.shape
    nope = q_nope.shape[1]
    rms_norm_into(np.ascontiguousarray(compressed[:, :rank]), kv_a_norm, latent_eps, latent)
    rotate_into(np.ascontiguousarray(compressed[:, rank:]).reshape(1, 1, -1), cos, sin, positions, rope_dim,
                interleaved, k_pe)
    q_heads = q.reshape(1, heads, -1)
    rotate_into(q_heads[:, :, nope:], cos, sin, positions, rope_dim, interleaved, q_pe)
    q_nope[:, :] = q_heads[0, :, :nope]
    fill_activation(absorb_act, q_nope, 0, q_nope.size)
    _products_per_head(absorb, nope, absorb_act, heads, rank, 0, q_latent.reshape(heads, 1, rank), nthreads)
    queries[0, :, :rank] = q_latent
    queries[0, :, rank:] = q_pe[0]
    stored[0, :rank] = latent[0]
    stored[0, rank:] = k_pe[0, 0]


@numba.njit(cache=True, nogil=True, inline="always")
def _output_steps(x, per_head, contexts, heads_matrix, heads_act, stride, first, attended, o, o_act, o_out, o_bias,
                  ffn_norm, eps, h, route, router, router_act, logits, logit_bias, bias, sigmoid, groups, topk_groups,
                  top2_sum, norm, route_scale, ids, weights, nthreads):
    """x += o(attended [1, heads, v width]) (+ o_bias, unless empty); h = the FFN norm of x;
    with `route`, the router's choice (ids, weights) for h (its logits + logit_bias, unless
    empty). With `per_head` (MLA), attended is first each head's context (`contexts` [heads,
    rank]) times its slice of kv_b (rows first + head * stride onwards)."""
    heads = attended.shape[1]
    if per_head:
        fill_activation(heads_act, contexts, 0, contexts.size)
        _products_per_head(heads_matrix, contexts.shape[1], heads_act, heads, stride, first,
                           attended.reshape(heads, 1, -1), nthreads)
    flat = attended.reshape(1, -1)
    cols = flat.shape[1]
    fill_activation(o_act, flat, 0, cols)
    _product(o, o_act, o_out, cols, nthreads)
    if o_bias.size:
        _add(o_out[0], o_bias)
    for i in range(x.shape[1]):
        x[0, i] += o_out[0, i]
    rms_norm_into(x, ffn_norm, eps, h)
    if route:
        fill_activation(router_act, h, 0, h.shape[1])
        _product(router, router_act, logits, h.shape[1], nthreads)
        if logit_bias.size:
            _add(logits[0], logit_bias)
        route_into(logits, bias, sigmoid, groups, topk_groups, top2_sum, norm, route_scale, ids, weights)


@numba.njit(cache=True, nogil=True, parallel=True)
def _output_kernel(x, per_head, contexts, heads_matrix, heads_act, stride, first, attended, o, o_act, o_out, o_bias,
                   ffn_norm, eps, h, route, router, router_act, logits, logit_bias, bias, sigmoid, groups, topk_groups,
                   top2_sum, norm, route_scale, ids, weights, nthreads):
    _output_steps(x, per_head, contexts, heads_matrix, heads_act, stride, first, attended, o, o_act, o_out, o_bias,
                  ffn_norm, eps, h, route, router, router_act, logits, logit_bias, bias, sigmoid, groups, topk_groups,
                  top2_sum, norm, route_scale, ids, weights, nthreads)


@numba.njit(cache=True, nogil=True, inline="always")
def _ffn_steps(h, gate, gate_act, up, up_act, up_distinct, gate_out, up_out, down, down_act, out, nthreads):
    """out = down(silu(gate(h)) * up(h)) for h [1, hidden]."""
    cols = h.shape[1]
    _fill_pair(h, gate_act, up_act, up_distinct)
    _products_of_two(cols, gate, gate_act, gate_out, up, up_act, up_out, nthreads)
    silu_times_rows(gate_out, up_out, 0, 1)
    ffn = gate_out.shape[1]
    fill_activation(down_act, gate_out, 0, ffn)
    _product(down, down_act, out, ffn, nthreads)


@numba.njit(cache=True, nogil=True, parallel=True)
def _ffn_kernel(h, gate, gate_act, up, up_act, up_distinct, gate_out, up_out, down, down_act, out, nthreads):
    _ffn_steps(h, gate, gate_act, up, up_act, up_distinct, gate_out, up_out, down, down_act, out, nthreads)


@numba.njit(cache=True, nogil=True, parallel=True)
def _routed_tail_kernel(x, per_head, contexts, heads_matrix, heads_act, stride, first, attended, o, o_act, o_out, o_bias,
                        ffn_norm, eps, h, route, router, router_act, logits, logit_bias, bias, sigmoid, groups,
                        topk_groups, top2_sum, norm, route_scale, ids, weights, table, records, slots, tags, offsets,
                        sizes, ffn, gate_acts, up_acts, up_distinct, expert_h, expert_up, expert_h_act, routed,
                        gate_bias, up_bias, down_bias, glu_kind, alpha, limit, shared, s_gate, s_gate_act, s_up,
                        s_up_act, s_up_distinct, s_gate_out, s_up_out, s_down, s_down_act, s_out, nthreads):
    """`_output_kernel`, then, when every chosen expert has a cache slot in `table` (each
    expert's row of `records`, -1 for none), the experts read there in place (`moe_steps`),
    with `shared` the shared expert (`_ffn_steps`), and the residual: x += routed (+ shared).
    False when one has none: x holds the attention output and h, ids and weights the router's
    choice, the experts still to run."""
    _output_steps(x, per_head, contexts, heads_matrix, heads_act, stride, first, attended, o, o_act, o_out, o_bias,
                  ffn_norm, eps, h, route, router, router_act, logits, logit_bias, bias, sigmoid, groups, topk_groups,
                  top2_sum, norm, route_scale, ids, weights, nthreads)
    for j in range(slots.size):
        expert = ids[0, j]
        if expert < 0 or expert >= table.size or table[expert] < 0 or table[expert] >= records.shape[0] or \
                (gate_bias.shape[0] and expert >= gate_bias.shape[0]):
            return False
        slots[j] = table[expert]
    moe_steps(tags[0], tags[1], tags[2], records, slots, offsets, sizes, ffn, h.shape[1], h, gate_acts, up_acts,
              up_distinct, expert_h, expert_up, expert_h_act, weights[0], routed, ids[0], gate_bias, up_bias, down_bias,
              glu_kind, alpha, limit, nthreads)
    if shared:
        _ffn_steps(h, s_gate, s_gate_act, s_up, s_up_act, s_up_distinct, s_gate_out, s_up_out, s_down, s_down_act,
                   s_out, nthreads)
        for i in range(routed.size):
            x[0, i] += routed[i] + s_out[0, i]
    else:
        for i in range(routed.size):
            x[0, i] += routed[i]
    return True


@numba.njit(cache=True, nogil=True, parallel=True)
def _dense_tail_kernel(x, per_head, contexts, heads_matrix, heads_act, stride, first, attended, o, o_act, o_out,
                       o_bias, ffn_norm, eps, h, route, router, router_act, logits, logit_bias, bias, sigmoid, groups,
                       topk_groups, top2_sum, norm, route_scale, ids, weights, gate, gate_act, up, up_act, up_distinct,
                       gate_out, up_out, down, down_act, out, nthreads):
    """`_output_kernel` then a dense FFN (`_ffn_steps`) and the residual: x += its output."""
    _output_steps(x, per_head, contexts, heads_matrix, heads_act, stride, first, attended, o, o_act, o_out, o_bias,
                  ffn_norm, eps, h, route, router, router_act, logits, logit_bias, bias, sigmoid, groups, topk_groups,
                  top2_sum, norm, route_scale, ids, weights, nthreads)
    _ffn_steps(h, gate, gate_act, up, up_act, up_distinct, gate_out, up_out, down, down_act, out, nthreads)
    for i in range(out.shape[1]):
        x[0, i] += out[0, i]


def _parts(matrix: kernels.Matrix) -> tuple:
    """What the kernels take of a matrix: (block tag, bytes, bytes per row)."""
    return matrix.tag, matrix.data, matrix.row_nbytes


def _activation_for(matrix: kernels.Matrix, values: np.ndarray):
    """The activation buffer `matrix` multiplies `values` [n, cols] through: `values` itself on
    the float path, else an int8 activation the kernels fill from it."""
    return values if matrix.dot_type is None else matrix.empty_activation(values.shape[0])


class FFNStep:
    """down(silu(gate(h)) * up(h)) of one row in one call, for a dense FFN or an ungated shared
    expert (`model.DenseFFN`); reads its input from `h` [1, hidden] when called."""

    def __init__(self, ffn, h: np.ndarray):
        self.h = h
        self.gate, self.up, self.down = (_parts(m) for m in (ffn.gate, ffn.up, ffn.down))
        self.gate_out, self.up_out = (np.empty((1, m.rows), F32) for m in (ffn.gate, ffn.up))
        self.gate_act = _activation_for(ffn.gate, h)
        same = ffn.up.dot_type == ffn.gate.dot_type
        self.up_act, self.up_distinct = (self.gate_act if same else _activation_for(ffn.up, h)), not same
        self.down_act = _activation_for(ffn.down, self.gate_out)
        self.out = np.empty((1, ffn.down.rows), F32)

    def arguments(self) -> tuple:
        """The FFN kernel's arguments between h and the thread count."""
        return (self.gate, self.gate_act, self.up, self.up_act, self.up_distinct, self.gate_out, self.up_out, self.down,
                self.down_act, self.out)

    def __call__(self) -> np.ndarray:
        """The FFN of the current `h` [1, hidden] (a buffer, overwritten by the next call)."""
        _ffn_kernel(self.h, *self.arguments(), thread_count())
        return self.out


class _LayerStep:
    """What the GQA, MLA and DeltaNet steps share: the output kernel after the token mixer, and
    the FFN. `attended` [1, heads, width] is what the mixer (MLA: kv_b per head) writes."""

    def __init__(self, attention, attn_norm: np.ndarray, ffn_norm: np.ndarray, ffn, heads: int = 0, width: int = 0):
        c = self.c = attention.c
        self.attention, self.attn_norm, self.ffn_norm, self.ffn = attention, attn_norm, ffn_norm, ffn
        self.h = np.empty((1, c.hidden_size), F32)
        self.positions = np.empty(1, np.int64)
        self.attended = np.empty((1, heads or c.n_heads, width or c.v_head_dim), F32)
        self.o = _parts(attention.o)
        self.o_act = _activation_for(attention.o, self.attended.reshape(1, -1))
        self.o_out = np.empty((1, c.hidden_size), F32)
        empty = np.empty(0, F32)  # no bias
        self.o_bias = empty if getattr(attention, "o_bias", None) is None else attention.o_bias
        self.routed = hasattr(ffn, "router")  # a routed MoE (else a dense FFN)
        self.logit_bias = ffn.router.logit_bias if self.routed and ffn.router.logit_bias is not None else empty
        if self.routed:
            gate = ffn.router.gate
            self.router, self.router_act = _parts(gate), _activation_for(gate, self.h)
            self.logits = np.empty((1, gate.rows), F32)
            self.bias = ffn.router.bias if ffn.router.bias is not None else np.zeros(gate.rows, F32)
            shared = ffn.shared
        else:  # not read: the kernel's router arguments typed by the o product's
            self.router, self.router_act, self.logits, self.bias = self.o, self.o_act, self.o_out, np.zeros(1, F32)
            shared = ffn
        self.ffn_step = FFNStep(shared, self.h) if shared is not None and getattr(shared, "sigmoid_gate", None) is None \
            else None
        # the FFN in the output kernel's call: a dense FFN always, routed experts when they are
        # all cached (the kernel looks them up in the store's slot table), with the shared expert
        # unless it is gated (Qwen2-MoE's: then the FFN runs after the output kernel)
        self.shared_args = self.ffn_step.arguments() if self.ffn_step is not None else None
        self.experts_args = None
        if self.routed and (shared is None or self.ffn_step is not None):
            experts, k = ffn.experts, c.n_experts_used
            self.experts_args = (ffn.store.records(ffn.layer), np.empty(k, np.int64), experts.tags, experts.offsets,
                                 experts.sizes, experts.ffn, *experts.scratch(self.h, k), np.empty(c.hidden_size, F32),
                                 *experts.biases, *experts.glu)
            placeholder = (self.o, self.o_act, self.o, self.o_act, False, self.o_out, self.o_out, self.o, self.o_act,
                           self.o_out)  # not read: typed as the o product
            self.experts_args += (shared is not None, *(self.shared_args or placeholder))
        k = c.n_experts_used if self.routed else 1
        self.ids, self.weights = np.empty((1, k), np.int64), np.empty((1, k), F32)  # the router's choice
        self.sinks = np.full(heads or c.n_heads, kernels.NO_SINK, F32)  # attention without sinks
        self.output_args = self.output_arguments(False, self.attended[0], self.o, self.o_act, 0, 0)

    def output_arguments(self, per_head: bool, contexts: np.ndarray, heads_matrix: tuple, heads_act, stride: int,
                         first: int) -> tuple:
        """The output kernel's arguments between x and the thread count, made once; with
        `per_head` (MLA), kv_b's slice of each head (`heads_matrix` from row `first`, `stride`
        rows a head) first turns the `contexts` into `attended`."""
        c = self.c
        return (per_head, contexts, heads_matrix, heads_act, stride, first, self.attended, self.o, self.o_act,
                self.o_out, self.o_bias, self.ffn_norm, F32(c.norm_eps), self.h, self.routed, self.router,
                self.router_act, self.logits, self.logit_bias, self.bias, c.router == "sigmoid", c.router_groups,
                c.router_topk_groups, c.router_group_score == "top2_sum", c.router_norm_topk,
                F32(c.routed_scaling_factor), self.ids, self.weights)

    def finish(self, x: np.ndarray) -> np.ndarray:
        """x with the attention output in `attended` and then the FFN added (in place when the
        FFN runs in the output kernel's call)."""
        ffn = self.ffn
        if not self.routed:
            _dense_tail_kernel(x, *self.output_args, *self.shared_args, thread_count())
            return x
        table = ffn.store.slot_table(ffn.layer) if self.experts_args is not None and ffn.observe is None else None
        if table is None:
            _output_kernel(x, *self.output_args, thread_count())
        elif _routed_tail_kernel(x, *self.output_args, table, *self.experts_args, thread_count()):
            ffn.ran_cached(self.ids, self.weights)
            return x
        out = ffn.routed(self.h, self.ids, self.weights)
        if ffn.shared is not None:
            out = out + (self.ffn_step() if self.ffn_step is not None else ffn.shared(self.h))
        return x + out


class DecodeLayer(_LayerStep):
    """One token through a GQA `model.Attention` layer and the FFN after it: x [1, hidden] ->
    the layer's output (x itself gets the attention output added)."""

    def __init__(self, attention, attn_norm: np.ndarray, ffn_norm: np.ndarray, ffn):
        super().__init__(attention, attn_norm, ffn_norm, ffn)
        c, a = self.c, attention
        qkv = (a.q, a.k, a.v)
        outs = tuple(np.empty((1, m.rows), F32) for m in qkv)
        shared = {}  # one activation per dot type, as Attention.project
        for m in qkv:
            shared.setdefault(m.dot_type, _activation_for(m, self.h))
        acts = tuple(shared[m.dot_type] for m in qkv)
        distinct = tuple(all(act is not earlier for earlier in acts[:i]) for i, act in enumerate(acts))  # each quantized once
        empty = np.empty(0, F32)
        biases = tuple(a.bias) if a.bias else (empty,) * 3
        norms = (a.q_norm, a.k_norm) if c.qk_norm != "none" else (empty, empty)
        self.query_args = (self.attn_norm, F32(c.norm_eps), self.h, tuple(m.tag for m in qkv),
                           tuple(m.data for m in qkv), tuple(m.row_nbytes for m in qkv), *acts, distinct, outs, biases,
                           norms, QK_NORMS[c.qk_norm], F32(c.clip_qkv or 0), a.rope.cos, a.rope.sin, self.positions,
                           a.rope.dim, a.rope.interleaved, c.n_heads, c.n_kv_heads)
        self.q, self.k, self.v = outs[0].reshape(1, c.n_heads, c.head_dim), outs[1], outs[2]
        if a.sinks is not None:
            self.sinks = np.ascontiguousarray(a.sinks, dtype=F32)
        self.scale = F32(a.scale)

    def __call__(self, x: np.ndarray, position: int, cache) -> np.ndarray:
        c, a = self.c, self.attention
        self.positions[0] = position
        _qkv_kernel(x, *self.query_args, thread_count())
        cache.write(a.layer, "k", position, self.k)
        cache.write(a.layer, "v", position, self.v)
        first = cache.first(a.layer, "k")
        keys = cache.stored(a.layer, "k", position + 1).reshape(position + 1 - first, c.n_kv_heads, c.head_dim)
        values = cache.stored(a.layer, "v", position + 1).reshape(position + 1 - first, c.n_kv_heads, c.v_head_dim)
        # attention through the general path's own kernels: compiled inside another kernel, its
        # loops could be vectorized differently, and the two paths would part by a few ulps
        kernels.attention_into(self.q, keys, values, position, first, a.window, self.sinks, kernels.NO_CHOICE,
                               self.scale, self.attended)
        if a.gate is not None:  # Qwen3-Next's output gate, as model.Attention applies it
            self.attended[:] = kernels.sigmoid_gated(self.attended, a.gate(self.h).reshape(self.attended.shape))
        return self.finish(x)


class DeltaNetDecodeLayer(_LayerStep):
    """One token through a `deltanet.GatedDeltaNet` layer and the FFN after it: the mixer as the
    general path runs it, then the output kernel (ssm_out, the residual, the FFN norm and the
    router) and the FFN as the attention steps run them."""

    def __init__(self, mixer, attn_norm: np.ndarray, ffn_norm: np.ndarray, ffn):
        super().__init__(mixer, attn_norm, ffn_norm, ffn, mixer.c.linear_v_heads, mixer.c.linear_v_head_dim)

    def __call__(self, x: np.ndarray, position: int, cache) -> np.ndarray:
        rms_norm_into(x, self.attn_norm, F32(self.c.norm_eps), self.h)
        self.attended[:] = self.attention.mixed(self.h, [(slice(0, 1), position, cache)]).reshape(self.attended.shape)
        return self.finish(x)


class LatentDecodeLayer(_LayerStep):
    """One token through an MLA `model.LatentAttention` layer and the FFN after it: x [1, hidden]
    -> the layer's output (x itself gets the attention output added)."""

    def __init__(self, attention, attn_norm: np.ndarray, ffn_norm: np.ndarray, ffn):
        super().__init__(attention, attn_norm, ffn_norm, ffn)
        c, a = self.c, attention
        heads, nope, rope, rank = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        lora = bool(c.q_lora_rank)
        first = a.q_a if lora else a.q
        first_act, first_out = _activation_for(first, self.h), np.empty((1, first.rows), F32)
        kv_distinct = a.kv_a.dot_type != first.dot_type
        kv_act = _activation_for(a.kv_a, self.h) if kv_distinct else first_act
        if lora:
            self.q_low = np.empty((1, a.q_a.rows), F32)
            q_b, q_b_act, q = _parts(a.q_b), _activation_for(a.q_b, self.q_low), np.empty((1, a.q_b.rows), F32)
            q_a_norm = a.q_a_norm
        else:  # not read: typed as the first product's
            q_a_norm, q_b, q_b_act, self.q_low, q = self.attn_norm, _parts(first), first_act, first_out, first_out
        q_nope = np.empty((heads, nope), F32)
        self.queries, self.stored = np.empty((1, heads, rank + rope), F32), np.empty((1, rank + rope), F32)
        self.query_args = (self.attn_norm, F32(c.norm_eps), F32(a.latent_eps), self.h, _parts(first), first_act,
                           first_out, _parts(a.kv_a), kv_act, kv_distinct, np.empty((1, rank + rope), F32), lora,
                           q_a_norm, q_b, q_b_act, self.q_low, q, a.kv_a_norm, np.empty((1, rank), F32), a.rope.cos,
                           a.rope.sin, self.positions, a.rope.dim, a.rope.interleaved, _parts(a.k_absorb), q_nope,
                           _activation_for(a.k_absorb, q_nope), np.empty((heads, rank), F32),
                           np.empty((1, heads, rope), F32), np.empty((1, 1, rope), F32), self.queries, self.stored)
        contexts = np.empty((heads, rank), F32)
        self.contexts = contexts.reshape(1, heads, rank)
        self.output_args = self.output_arguments(True, contexts, _parts(a.kv_b), _activation_for(a.kv_b, contexts),
                                                 nope + c.v_head_dim, nope)
        self.scale = F32(a.scale)

    def __call__(self, x: np.ndarray, position: int, cache) -> np.ndarray:
        c, a = self.c, self.attention
        self.positions[0] = position
        _latent_query_kernel(x, *self.query_args, thread_count())
        cache.write(a.layer, "kv", position, self.stored)
        keys = cache.stored(a.layer, "kv", position + 1)[:, None, :]
        chosen = a.choose(cache, self.q_low, self.h, self.positions, position) if c.index_topk else None
        # attention through the general path's own kernels (see DecodeLayer)
        kernels.attention_into(self.queries, keys, keys[:, :, :c.kv_lora_rank], position, 0, 0, self.sinks,
                               kernels.NO_CHOICE if chosen is None else np.ascontiguousarray(chosen, dtype=np.uint8),
                               self.scale, self.contexts)
        return self.finish(x)
