"""float32 math the kernels share, in loops that vectorize: softmax and silu on an exp without
libm calls, and the RMS norm. Their sums are `float_sum` / `float_dot`, in one fixed order, so
that a kernel gives the same bits in whatever function it is compiled into.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from colibri.runtime.kernels.emitter import float_dot, float_sum, int_bits_to_float

F32 = np.float32


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _exp_nonpositive(x):
    """exp(x) for x <= 0 to 4e-6 relative (x clamped at -87), without a libm call, so that a
    loop of them vectorizes: 2**(x log2 e) as 2**floor times a degree-8 Taylor polynomial of
    the fraction."""
    t = max(x, F32(-87.0)) * F32(1.4426950408889634)
    whole = np.floor(t)
    f = (t - whole) * F32(0.6931471805599453)
    p = F32(1.0 / 40320.0)
    for c in (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * f + F32(c)
    return p * int_bits_to_float((np.int32(whole) + np.int32(127)) << np.int32(23))


@njit(cache=True, nogil=True, fastmath=True)
def softmax_in_place(scores, i, lo, end, sink):
    """scores[i, lo:end] (float32) <- their softmax, with `_exp_nonpositive`; a finite `sink`
    is one more logit in the denominator (an attention sink, whose share is dropped). Not
    inlined: inlined into the decode attention's parallel loop, it took away the second
    thread's gain."""
    row = scores[i, lo:end]  # (a view: loops from a variable start did not vectorize)
    best = F32(-3.0e38)
    for pos in range(row.size):
        best = max(best, row[pos])
    sink_share = F32(0.0)
    if sink > F32(-3.0e38):
        best = max(best, sink)
        sink_share = _exp_nonpositive(sink - best)
    for pos in range(row.size):
        row[pos] = _exp_nonpositive(row[pos] - best)
    inverse = F32(1.0) / (float_sum(row) + sink_share)
    for pos in range(row.size):
        row[pos] *= inverse


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def silu(v):
    """v * sigmoid(v), from exp(-|v|): no overflow, and a loop of them vectorizes."""
    e = _exp_nonpositive(-abs(v))
    return v * (F32(1.0) if v >= 0 else e) / (F32(1.0) + e)


GLU_SILU, GLU_CLAMPED, GLU_CLAMPED_SILU = 0, 1, 2  # the gated activations of `glu`
GLU_KINDS = {"silu": GLU_SILU, "clamped_swiglu": GLU_CLAMPED,
             "clamped_silu": GLU_CLAMPED_SILU}  # ModelConfig.expert_glu -> its kind


class GLU(NamedTuple):
    """A gated activation as `glu` takes it: its kind (GLU_KINDS' values), alpha and limit."""

    kind: int
    alpha: np.float32
    limit: np.float32


SILU = GLU(GLU_SILU, F32(1.0), F32(0.0))


def glu_of(config) -> GLU:
    """The GLU of a model's experts (`ModelConfig.expert_glu`), which its dense FFNs and shared experts share."""
    return GLU(GLU_KINDS[config.expert_glu], F32(config.swiglu_alpha), F32(config.swiglu_limit))


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def glu(gate, up, kind, alpha, limit):
    """silu(gate) * up (GLU_SILU), or with gate clipped above at `limit` and up to [-limit,
    limit]: silu(gate) * up (GLU_CLAMPED_SILU, DeepSeek-V4's), or gpt-oss's clamped SwiGLU
    (GLU_CLAMPED), (up + 1) * gate * sigmoid(alpha * gate)."""
    if kind == GLU_SILU:
        return silu(gate) * up
    g, u = min(gate, limit), min(max(up, -limit), limit)
    if kind == GLU_CLAMPED_SILU:
        return silu(g) * u
    e = _exp_nonpositive(-abs(alpha * g))
    return (u + F32(1.0)) * g * (F32(1.0) if g >= 0 else e) / (F32(1.0) + e)


@njit(cache=True, nogil=True, fastmath=True)
def rms_norm_into(x, weight, eps, out):
    """out[i] = x[i] / rms(x[i]) * weight for each row of x (float32 [n, width])."""
    for i in range(x.shape[0]):
        inverse = F32(1.0) / np.sqrt(float_dot(x[i], x[i]) / F32(x.shape[1]) + eps)
        for j in range(x.shape[1]):
            out[i, j] = x[i, j] * inverse * weight[j]


def sigmoid_gated(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """x times sigmoid(gate), elementwise (float32), as x / (1 + exp(-gate)): the output gates
    of gated attention and of Qwen2-MoE's shared expert, one expression for every path."""
    return x / (F32(1) + np.exp(-gate))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * weight over the last axis (float32)."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    rms_norm_into(rows, np.ascontiguousarray(weight, dtype=np.float32), F32(eps), out)
    return out.reshape(x.shape)
