"""A decoded token's attention and routing: a layer's small steps fused into two numba calls.

A decoded token runs each layer's q, k, v, o, router and expert products on one activation
vector. Called one at a time from Python, with the norms, bias, clip, rotary, attention,
residual and top-k steps between them, every step of a layer is a numba or numpy call of its
own. `DecodeLayer` does the same work, for a GQA attention layer followed by a routed MoE, in
the three steps below (bench/RESULTS.md has what it saves per token):

1. `_qkv_kernel`: attention norm, the q/k/v products on all threads in one parallel region,
   then their bias, q/k norms, clip and rotation;
2. the KV cache write and the attention (`kernels.attention`), as the general path;
3. `_output_and_route`: the o product, the residual, the FFN norm, the router product and
   the top-k choice;

all steps with the arithmetic of `model.Attention` / `model.Router`, which serve prompts and
the other architectures, so both paths give the same bits (tests/test_fused.py). Their
scratch arrays are allocated once per layer.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from colibri.runtime import kernels
from colibri.runtime.kernels.activations import fill_activation
from colibri.runtime.kernels.numerics import rms_norm_into
from colibri.runtime.kernels.routing import route_into
from colibri.runtime.kernels.rows import rows_times
from colibri.runtime.kernels.threads import part_range
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
def _output_and_route(attended, o_tag, o_w, o_nbytes, o_act, o_out, x, ffn_norm, eps, h, router_tag, router_w,
                      router_nbytes, router_act, logits, bias, sigmoid, groups, topk_groups, top2_sum, norm, route_scale,
                      ids, weights, nthreads):
    flat = attended.reshape(1, -1)
    cols = flat.shape[1]
    fill_activation(o_act, flat, 0, cols)
    for t in prange(nthreads):
        lo, hi = part_range(o_out.shape[1], nthreads, t, 1)
        rows_times(o_tag, o_w, lo, hi, o_nbytes, cols, o_act, o_out)
    for i in range(x.shape[1]):
        x[0, i] += o_out[0, i]
    rms_norm_into(x, ffn_norm, eps, h)
    fill_activation(router_act, h, 0, h.shape[1])
    rows_times(router_tag, router_w, 0, logits.shape[1], router_nbytes, h.shape[1], router_act, logits)
    route_into(logits, bias, sigmoid, groups, topk_groups, top2_sum, norm, route_scale, ids, weights)


def _activation_for(matrix: kernels.Matrix, values: np.ndarray):
    """The activation buffer `matrix` multiplies `values` [1, cols] through: `values` itself on
    the float path, else an int8 activation the kernels fill from it."""
    return values if matrix.dot_type is None else matrix.empty_activation(1)


class DecodeLayer:
    """One token through a GQA `model.Attention` layer and the router of the `model.MoE` after
    it: x [1, hidden] gets the attention output added in place; returns the FFN input h and
    the routing (ids [1, k], weights [1, k]) for `MoE.apply`."""

    def __init__(self, attention, attn_norm: np.ndarray, ffn_norm: np.ndarray, moe):
        c = self.c = attention.c
        self.attention, self.attn_norm, self.ffn_norm, self.router = attention, attn_norm, ffn_norm, moe.router
        self.h = np.empty((1, c.hidden_size), np.float32)
        qkv = (attention.q, attention.k, attention.v)
        self.qkv = tuple(m.tag for m in qkv), tuple(m.data for m in qkv), tuple(m.row_nbytes for m in qkv)
        self.outs = tuple(np.empty((1, m.rows), np.float32) for m in qkv)
        self.positions = np.empty(1, np.int64)
        shared = {}  # one activation per dot type, as Attention.project
        for m in qkv:
            shared.setdefault(m.dot_type, _activation_for(m, self.h))
        self.qkv_acts = tuple(shared[m.dot_type] for m in qkv)
        self.distinct = tuple(all(act is not earlier for earlier in self.qkv_acts[:i])
                              for i, act in enumerate(self.qkv_acts))  # each quantized once
        empty = np.empty(0, np.float32)
        self.biases = tuple(attention.bias) if attention.bias else (empty,) * 3
        self.norms = (attention.q_norm, attention.k_norm) if c.qk_norm != "none" else (empty, empty)
        self.attended = np.empty((1, c.n_heads, c.v_head_dim), np.float32)
        self.o_act = _activation_for(attention.o, self.attended.reshape(1, -1))
        self.o_out = np.empty((1, c.hidden_size), np.float32)
        gate = self.router.gate
        self.router_act, self.logits = _activation_for(gate, self.h), np.empty((1, gate.rows), np.float32)
        self.bias = self.router.bias if self.router.bias is not None else np.zeros(gate.rows, np.float32)

    def __call__(self, x: np.ndarray, position: int, cache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c, a, threads = self.c, self.attention, numba.get_num_threads()
        self.positions[0] = position
        _qkv_kernel(x, self.attn_norm, F32(c.norm_eps), self.h, *self.qkv, *self.qkv_acts, self.distinct, self.outs,
                    self.biases, self.norms, QK_NORMS[c.qk_norm], F32(c.clip_qkv or 0), a.rope.cos, a.rope.sin,
                    self.positions, a.rope.dim, a.rope.interleaved, c.n_heads, c.n_kv_heads, threads)
        q, k, v = self.outs
        cache.write(a.layer, "k", position, k)
        cache.write(a.layer, "v", position, v)
        end = position + 1
        keys = cache.stored(a.layer, "k", end).reshape(end, c.n_kv_heads, c.head_dim)
        values = cache.stored(a.layer, "v", end).reshape(end, c.n_kv_heads, c.v_head_dim)
        # attention through the general path's own call: compiled inside another kernel, its
        # loops could be vectorized differently, and the two paths would part by a few ulps
        self.attended[:] = kernels.attention(q.reshape(1, c.n_heads, c.head_dim), keys, values, position, a.scale)
        ids, weights = np.empty((1, c.n_experts_used), np.int64), np.empty((1, c.n_experts_used), np.float32)
        o, gate = a.o, self.router.gate
        _output_and_route(self.attended, o.tag, o.data, o.row_nbytes, self.o_act, self.o_out, x, self.ffn_norm,
                          F32(c.norm_eps), self.h, gate.tag, gate.data, gate.row_nbytes, self.router_act, self.logits,
                          self.bias, c.router == "sigmoid", c.router_groups, c.router_topk_groups,
                          c.router_group_score == "top2_sum", c.router_norm_topk, F32(c.routed_scaling_factor), ids,
                          weights, threads)
        return self.h, ids, weights
