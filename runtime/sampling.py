"""Next-token sampling from logits: greedy, or llama.cpp's top-k → top-p → min-p → temperature chain."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams", "Sampler"]

#: top-p first sorts only the tokens within this many logits of the largest
_TOP_P_WINDOW = 10.0


@dataclass
class SamplingParams:
    """``temperature`` 0 means greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 disable their filter."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class Sampler:
    """Picks the next token id from float logits ``[vocab]``.

    Greedy (temperature 0) is the argmax, ties to the lowest id.  Otherwise, in llama.cpp's
    order: keep the ``top_k`` largest logits (ties to lower ids), then the smallest
    most-probable set whose probability reaches ``top_p``, then the tokens with probability
    >= ``min_p`` x the largest, divide the logits by ``temperature`` and draw from the
    softmax with ``Generator(PCG64(seed))`` (one generator per sampler, so a sequence of
    calls is reproducible for a seed).
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self._rng = np.random.Generator(np.random.PCG64(params.seed))

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        if not np.isfinite(logits.max()):
            raise ValueError("logits must have a finite maximum (no NaN or +inf, not all -inf)")
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))

        ids = np.arange(logits.size)
        if 0 < p.top_k < logits.size:
            kth = np.partition(logits, -p.top_k)[-p.top_k]
            above = np.flatnonzero(logits > kth)
            tied = np.flatnonzero(logits == kth)[: p.top_k - above.size]
            ids = np.sort(np.concatenate([above, tied]))
        x = logits[ids].astype(np.float64)
        if p.top_p < 1:
            probs = _softmax(x)
            # sort only the likely tokens when they alone reach top_p (same result, much faster)
            order = np.flatnonzero(x >= x.max() - _TOP_P_WINDOW)
            if probs[order].sum() < p.top_p + 1e-9:
                order = np.arange(x.size)
            order = order[np.argsort(-x[order], kind="stable")]  # most probable first, ties to lower ids
            keep = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1
            ids, x = ids[order[:keep]], x[order[:keep]]
        if p.min_p > 0:
            mask = x >= x.max() + np.log(p.min_p)  # prob >= min_p * max prob
            ids, x = ids[mask], x[mask]
        cdf = np.cumsum(_softmax(x / p.temperature))
        i = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        return int(ids[min(i, ids.size - 1)])
