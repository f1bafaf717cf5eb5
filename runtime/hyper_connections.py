"""Manifold-constrained hyper-connections (DeepSeek-V4's mHC): several residual streams instead of one.

A token's state between blocks is `streams` vectors of the hidden width. Before each block
(attention, then the FFN) a small projection of all of them, normalized, gives three sets of
weights: `pre` collapses the streams into the block's input, `post` spreads the block's
output over the streams, and `comb` [src, dst] mixes the streams themselves; `comb` is made
doubly stochastic by Sinkhorn rounds (softmax over dst, one column normalization, then
rows and columns in turn), each denominator plus `eps`, as transformers' and llama.cpp's
DeepSeek-V4 compute it. The model's head collapses the streams with weights of its own.
Everything here runs in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

F32 = np.float32


class HyperWeights(NamedTuple):
    """One mixing site's tensors: fn, a `kernels.Matrix` [(2 + streams) * streams, streams *
    hidden] (the head's: [streams, streams * hidden]); base [its rows], scale [3] (the head's: [1])."""

    fn: object
    base: np.ndarray
    scale: np.ndarray


def _flat_normalized(x: np.ndarray, norm_eps: float) -> np.ndarray:
    """x [n, streams, hidden] flattened per row and divided by its root mean square (no weight)."""
    flat = x.reshape(x.shape[0], -1)
    return flat / np.sqrt(np.mean(flat * flat, axis=1, keepdims=True, dtype=F32) + F32(norm_eps))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1) / (F32(1) + np.exp(-x))


def mix(x: np.ndarray, w: HyperWeights, iters: int, eps: float, norm_eps: float):
    """(collapsed [n, hidden], post [n, streams], comb [n, streams, streams]) of the streams x
    [n, streams, hidden] at one mixing site."""
    streams, eps = x.shape[1], F32(eps)
    m = w.fn(_flat_normalized(x, norm_eps))
    pre = _sigmoid(m[:, :streams] * w.scale[0] + w.base[:streams]) + eps
    post = F32(2) * _sigmoid(m[:, streams:2 * streams] * w.scale[1] + w.base[streams:2 * streams])
    logits = (m[:, 2 * streams:] * w.scale[2] + w.base[2 * streams:]).reshape(-1, streams, streams)
    comb = np.exp(logits - logits.max(axis=2, keepdims=True))
    comb = comb / comb.sum(axis=2, keepdims=True) + eps
    comb = comb / (comb.sum(axis=1, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=2, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=1, keepdims=True) + eps)
    collapsed = np.einsum("ns,nsd->nd", pre, x).astype(F32)
    return collapsed, post.astype(F32), comb.astype(F32)


def merge(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """The streams after a block: stream dst = post[dst] * y + sum over src of comb[src, dst] * x[src]."""
    return (post[:, :, None] * y[:, None, :] + np.einsum("nsd,nsh->ndh", comb, x)).astype(F32)


def head(x: np.ndarray, w: HyperWeights, eps: float, norm_eps: float) -> np.ndarray:
    """The streams x [n, streams, hidden] collapsed into one [n, hidden] for the final norm."""
    pre = _sigmoid(w.fn(_flat_normalized(x, norm_eps)) * w.scale[0] + w.base) + F32(eps)
    return np.einsum("ns,nsd->nd", pre, x).astype(F32)
