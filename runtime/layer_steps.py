"""The steps of a layer both paths run on its record: one numba function each, for any number of rows.

A prompt's rows (`model.Attention`) and a decoded token (`fused.DecodeLayer`) go through the
same compiled step, so what a `GQAInput` asks for (a bias, a norm, a clip, the rotation) is
written once.
"""

from __future__ import annotations

import numba
import numpy as np

from colibri.runtime.kernels.numerics import rms_norm_into
from colibri.runtime.rope import rotate_into


@numba.njit(cache=True, nogil=True)
def _add_rows(values, bias):
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            values[i, j] += bias[j]


@numba.njit(cache=True, nogil=True)
def _clip(values, limit):
    flat = values.reshape(-1)
    for i in range(flat.size):
        flat[i] = min(max(flat[i], -limit), limit)


@numba.njit(cache=True, nogil=True)
def _scale(values, factor):
    flat = values.reshape(-1)
    for i in range(flat.size):
        flat[i] *= factor


@numba.njit(cache=True, nogil=True)
def finish_qkv(rec, q, k, v, positions):
    """q [n, heads * width], k [n, kv heads * width], v [n, kv heads * v width] (C-contiguous,
    the products of a layer's `GQAInput`) in place: + their biases, v's scale, the q/k norms,
    the clip, then q and k rotated at `positions` [n] (the norms after it when `norm_after_rope`),
    then q's temperature."""
    n = q.shape[0]
    if rec.q_bias.size:
        _add_rows(q, rec.q_bias)
        _add_rows(k, rec.k_bias)
        _add_rows(v, rec.v_bias)
    if rec.v_scale != 1:
        _scale(v, rec.v_scale)
    if rec.qk_norm == 1:
        rms_norm_into(q, rec.q_norm, rec.eps, q)
        rms_norm_into(k, rec.k_norm, rec.eps, k)
    if rec.clip > 0:
        _clip(q, rec.clip)
        _clip(k, rec.clip)
        _clip(v, rec.clip)
    q_heads, k_heads = q.reshape(n, rec.heads, -1), k.reshape(n, rec.kv_heads, -1)
    if rec.qk_norm == 2 and not rec.norm_after_rope:
        _head_norms(rec, q_heads, k_heads)
    rotate_into(q_heads, rec.rope, positions, q_heads)
    rotate_into(k_heads, rec.rope, positions, k_heads)
    if rec.qk_norm == 2 and rec.norm_after_rope:
        _head_norms(rec, q_heads, k_heads)
    if rec.temperature_scale > 0:
        _temperature(q, positions, rec.temperature_scale, rec.temperature_floor)


@numba.njit(cache=True, nogil=True)
def _temperature(q, positions, scale, floor):
    """Row i of q times 1 + scale * ln(1 + floor((positions[i] + 1) / floor)) (Llama 4's
    temperature tuning of its position-free layers, in float32 as transformers computes it)."""
    for i in range(q.shape[0]):
        steps = np.floor(np.float32(positions[i] + 1) / floor)
        factor = np.float32(np.log1p(steps)) * scale + np.float32(1)
        for j in range(q.shape[1]):
            q[i, j] *= factor


@numba.njit(cache=True, nogil=True)
def _head_norms(rec, q_heads, k_heads):
    """Each head of q [n, heads, width] and k [n, kv heads, width] RMS-normalized in place."""
    n = q_heads.shape[0]
    rms_norm_into(q_heads.reshape(n * rec.heads, -1), rec.q_norm, rec.eps, q_heads.reshape(n * rec.heads, -1))
    rms_norm_into(k_heads.reshape(n * rec.kv_heads, -1), rec.k_norm, rec.eps, k_heads.reshape(n * rec.kv_heads, -1))

