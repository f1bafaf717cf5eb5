"""Manifold-constrained hyper-connections (DeepSeek-V4's mHC): several residual streams instead of one.

A token's state between blocks is `streams` vectors of the hidden width. Before each block
(attention, then the FFN) a small projection of all of them, normalized, gives three sets of
weights: `pre` collapses the streams into the block's input, `post` spreads the block's
output over the streams, and `comb` [src, dst] mixes the streams themselves; `comb` is made
doubly stochastic by Sinkhorn rounds (softmax over dst, one column normalization, then
rows and columns in turn), each denominator plus `eps`, as transformers' and llama.cpp's
DeepSeek-V4 compute it. The model's head collapses the streams with weights of its own.
Everything here runs in float32, row by row in numba kernels that the prompt path and the
fused decode step (`runtime.fused.HyperDecodeLayer`) share, so both get the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from colibri.runtime.kernels.emitter import float_dot

F32 = np.float32
_njit = njit(cache=True, nogil=True)


class HyperWeights(NamedTuple):
    """One mixing site's tensors: fn, a `kernels.Matrix` [(2 + streams) * streams, streams *
    hidden] (the head's: [streams, streams * hidden]); base [its rows], scale [3] (the head's: [1])."""

    fn: object
    base: np.ndarray
    scale: np.ndarray


class Mixing(NamedTuple):
    """The mixing's scalars: Sinkhorn rounds, the denominators' epsilon, the norm's epsilon."""

    iters: int
    eps: np.float32
    norm_eps: np.float32


@njit(cache=True, nogil=True, fastmath=True)
def normalized_into(x, eps, out):
    """out[i] = x[i] / rms(x[i]) (no weight) for each row of x float32 [n, width]: a row is a
    token's streams flattened."""
    for i in range(x.shape[0]):
        inverse = F32(1.0) / np.sqrt(float_dot(x[i], x[i]) / F32(x.shape[1]) + eps)
        for j in range(x.shape[1]):
            out[i, j] = x[i, j] * inverse


@_njit
def _sigmoid(v):
    return F32(1.0) / (F32(1.0) + np.exp(-v))


@_njit
def _collapse_into(pre, x, out):
    """out [hidden] = sum over s of pre[s] * x[s] (x [streams, hidden])."""
    for d in range(x.shape[1]):
        total = F32(0.0)
        for s in range(x.shape[0]):
            total += pre[s] * x[s, d]
        out[d] = total


@_njit
def mixing_into(m, base, scale, x, mixing, collapsed, post, comb):
    """Each row's weights from m [n, (2 + streams) * streams] (fn of the normalized streams):
    post [n, streams], comb [n, streams, streams] (Sinkhorn), and collapsed [n, hidden], the
    streams x [n, streams, hidden] summed with `pre`."""
    streams, eps = x.shape[1], mixing.eps
    pre = np.empty(streams, F32)
    for i in range(x.shape[0]):
        for s in range(streams):
            pre[s] = _sigmoid(m[i, s] * scale[0] + base[s]) + eps
            post[i, s] = F32(2.0) * _sigmoid(m[i, streams + s] * scale[1] + base[streams + s])
        c = comb[i]
        for src in range(streams):  # softmax over dst
            row = 2 * streams + src * streams
            top = -np.inf
            for dst in range(streams):
                c[src, dst] = m[i, row + dst] * scale[2] + base[row + dst]
                top = max(top, c[src, dst])
            total = F32(0.0)
            for dst in range(streams):
                c[src, dst] = np.exp(c[src, dst] - top)
                total += c[src, dst]
            for dst in range(streams):
                c[src, dst] = c[src, dst] / total + eps
        _normalize_columns(c, eps)
        for _ in range(mixing.iters - 1):
            for src in range(streams):
                total = F32(0.0)
                for dst in range(streams):
                    total += c[src, dst]
                for dst in range(streams):
                    c[src, dst] = c[src, dst] / (total + eps)
            _normalize_columns(c, eps)
        _collapse_into(pre, x[i], collapsed[i])


@_njit
def _normalize_columns(c, eps):
    for dst in range(c.shape[1]):
        total = F32(0.0)
        for src in range(c.shape[0]):
            total += c[src, dst]
        for src in range(c.shape[0]):
            c[src, dst] = c[src, dst] / (total + eps)


@_njit
def merge_into(x, y, post, comb, out):
    """The streams after a block, out [n, streams, hidden]: stream dst = post[dst] * y + the sum
    over src of comb[src, dst] * x[src] (x the streams before it, y [n, hidden] its output)."""
    for i in range(x.shape[0]):
        for dst in range(x.shape[1]):
            for d in range(x.shape[2]):
                total = post[i, dst] * y[i, d]
                for src in range(x.shape[1]):
                    total += comb[i, src, dst] * x[i, src, d]
                out[i, dst, d] = total


def _normalized(x: np.ndarray, norm_eps: float) -> np.ndarray:
    flat = np.ascontiguousarray(x, dtype=F32).reshape(x.shape[0], -1)
    out = np.empty_like(flat)
    normalized_into(flat, F32(norm_eps), out)
    return out


def mix(x: np.ndarray, w: HyperWeights, mixing: Mixing):
    """(collapsed [n, hidden], post [n, streams], comb [n, streams, streams]) of the streams x
    [n, streams, hidden] at one mixing site."""
    n, streams, hidden = x.shape
    m = w.fn(_normalized(x, mixing.norm_eps))
    collapsed, post, comb = np.empty((n, hidden), F32), np.empty((n, streams), F32), np.empty((n, streams, streams), F32)
    mixing_into(m, w.base, w.scale, np.ascontiguousarray(x, dtype=F32), mixing, collapsed, post, comb)
    return collapsed, post, comb


def merge(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """`merge_into`'s streams, a new array."""
    out = np.empty(x.shape, F32)
    merge_into(np.ascontiguousarray(x, dtype=F32), np.ascontiguousarray(y, dtype=F32), post, comb, out)
    return out


def head(x: np.ndarray, w: HyperWeights, mixing: Mixing) -> np.ndarray:
    """The streams x [n, streams, hidden] collapsed into one [n, hidden] for the final norm."""
    logits = w.fn(_normalized(x, mixing.norm_eps)) * w.scale[0] + w.base
    pre = F32(1) / (F32(1) + np.exp(-logits)) + mixing.eps
    return np.einsum("ns,nsd->nd", pre, x).astype(F32)
