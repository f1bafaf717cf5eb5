"""runtime.sampling: greedy, seeded draws and llama.cpp's top-k / top-p / min-p filters."""

from __future__ import annotations


import numpy as np
import pytest

from colibri.runtime.sampling import Sampler, SamplingParams

VOCAB = 1000


def random_logits(seed: int, n: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, n).astype(np.float32)


def draws(params: SamplingParams, logits: np.ndarray, n: int) -> np.ndarray:
    sampler = Sampler(params)
    return np.array([sampler(logits) for _ in range(n)])


def probs_of(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits.astype(np.float64) - logits.max())
    return e / e.sum()


def test_greedy_is_argmax():
    sampler = Sampler(SamplingParams())
    for seed in range(20):
        logits = random_logits(seed)
        assert sampler(logits) == int(np.argmax(logits))
    tied = np.zeros(VOCAB, np.float32)
    tied[[7, 3, 500]] = 2.0
    assert sampler(tied) == 3  # ties go to the lowest id
    # filters do not matter at temperature 0
    assert Sampler(SamplingParams(top_k=5, top_p=0.1, min_p=0.5, seed=1))(tied) == 3


def test_seed_determinism():
    logits = random_logits(0)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=1234)
    a, b = draws(params, logits, 200), draws(params, logits, 200)
    assert np.array_equal(a, b)
    assert len(set(a.tolist())) > 1  # actually random
    assert not np.array_equal(a, draws(SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=1235),
                                        logits, 200))


def test_top_k_1_is_greedy():
    for seed in range(20):
        logits = random_logits(seed)
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed))(logits) == int(np.argmax(logits))
    tied = np.zeros(VOCAB, np.float32)
    tied[[9, 4]] = 1.0
    assert set(draws(SamplingParams(temperature=2.0, top_k=1, seed=0), tied, 50).tolist()) == {4}


def test_top_k_keeps_k_largest():
    logits = random_logits(3)
    top = set(np.argsort(-logits)[:5].tolist())
    got = draws(SamplingParams(temperature=5.0, top_k=5, seed=0), logits, 2000)
    assert set(got.tolist()) == top  # flat distribution: every one of the 5 is drawn


def test_temperature_one_matches_softmax():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    n = 20000
    counts = np.bincount(draws(SamplingParams(temperature=1.0, seed=7), logits, n), minlength=4)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    assert np.all(np.abs(counts / n - p) < 4 * np.sqrt(p * (1 - p) / n))


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (ids shuffled)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    perm = np.array([3, 0, 5, 1, 4, 2])
    logits = np.empty(6, np.float32)
    logits[perm] = np.log(p)
    n = 4000
    for top_p, kept in ((0.3, 1), (0.39, 1), (0.41, 2), (0.64, 2), (0.66, 3), (0.85, 4), (0.91, 5), (0.97, 6), (1.0, 6)):
        got = draws(SamplingParams(temperature=1.0, top_p=top_p, seed=11), logits, n)
        assert set(got.tolist()) == set(perm[:kept].tolist()), top_p
        # the kept tokens keep their relative probabilities
        expected = p[:kept] / p[:kept].sum()
        freq = np.bincount(got, minlength=6)[perm[:kept]] / n
        assert np.all(np.abs(freq - expected) < 4 * np.sqrt(expected * (1 - expected) / n) + 1e-9), top_p


def test_top_p_after_top_k():
    # llama.cpp order: top-p is computed on the probabilities renormalised over the top-k
    logits = np.log(np.array([0.3, 0.3, 0.2, 0.2], np.float32))
    got = draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=0), logits, 500)
    assert set(got.tolist()) == {0}  # over {0, 1} each has 0.5: one token reaches p


def test_min_p_removes_unlikely_tokens():
    # weights relative to the most likely token: min_p=0.2 keeps 1.0, 0.5 and 0.21, not 0.19
    rel = np.array([0.05, 0.5, 0.19, 1.0, 0.21, 0.1])
    got = draws(SamplingParams(temperature=3.0, min_p=0.2, seed=2), np.log(rel).astype(np.float32), 2000)
    assert set(got.tolist()) == {1, 3, 4}
    logits = random_logits(5, 200)
    probs = probs_of(logits)
    for min_p in (0.05, 0.2, 0.6):
        allowed = set(np.flatnonzero(probs >= min_p * probs.max()).tolist())
        assert set(draws(SamplingParams(temperature=3.0, min_p=min_p, seed=2), logits, 4000).tolist()) == allowed


def test_min_p_uses_untempered_probabilities():
    # min-p comes before temperature: a high temperature does not readmit removed tokens
    logits = np.log(np.array([0.6, 0.3, 0.1], np.float32))
    got = draws(SamplingParams(temperature=100.0, min_p=0.4, seed=3), logits, 2000)
    assert set(got.tolist()) == {0, 1}


def test_masked_logits_never_drawn():
    logits = np.full(50, -np.inf, np.float32)
    logits[[10, 20]] = [0.0, 1.0]
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, top_k=5, seed=0)):
        assert set(draws(params, logits, 500).tolist()) == {10, 20}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1}, {"temperature": float("nan")},
        {"top_k": -1}, {"top_k": 2.5}, {"top_k": True},
        {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2},
        {"min_p": -0.1}, {"min_p": 1.0},
    ],
)
def test_invalid_params_rejected(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_logits_rejected():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    for bad in (np.array([0.0, np.nan], np.float32), np.full(4, -np.inf, np.float32), np.zeros((2, 3), np.float32)):
        with pytest.raises(ValueError, match="logits"):
            sampler(bad)


def reference_sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """Straightforward llama.cpp chain (full sort), drawing with the uniform number ``u``."""
    ids = np.arange(logits.size)
    x = logits.astype(np.float64)
    if params.top_k:
        order = np.argsort(-x, kind="stable")[: params.top_k]
        ids, x = np.sort(order), x[np.sort(order)]
    if params.top_p < 1:
        order = np.argsort(-x, kind="stable")
        ids, x = ids[order], x[order]
        keep = int(np.searchsorted(np.cumsum(probs_of(x)), params.top_p)) + 1
        ids, x = ids[:keep], x[:keep]
    mask = probs_of(x) >= params.min_p * probs_of(x).max()
    ids, x = ids[mask], x[mask]
    cdf = np.cumsum(probs_of(x / params.temperature))
    return int(ids[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), ids.size - 1)])


def spike(seed: int) -> np.ndarray:
    """One token 10.5 logits above 5000 near-equal ones: top-p=0.9 must look beyond the likely tokens."""
    logits = np.random.default_rng(seed).normal(0.0, 0.01, 5000).astype(np.float32)
    logits[17 + seed] = 10.5
    return logits


@pytest.mark.parametrize("make", [
    lambda seed: random_logits(seed, 5000) * 0.01,
    lambda seed: random_logits(seed, 5000),
    lambda seed: random_logits(seed, 5000) * 30.0,
    lambda seed: np.round(random_logits(seed, 5000)),  # many ties
    spike,
], ids=["flat", "normal", "peaked", "ties", "spike"])
def test_matches_reference_chain(make):
    for seed in range(10):
        logits = np.asarray(make(seed), np.float32)
        for params in (
            SamplingParams(temperature=0.7, top_p=0.9, seed=seed),
            SamplingParams(temperature=1.3, top_k=100, top_p=0.5, min_p=0.02, seed=seed),
            SamplingParams(temperature=1.0, min_p=0.1, seed=seed),
        ):
            us = np.random.Generator(np.random.PCG64(seed)).random(20)
            got = draws(params, logits, 20)
            assert got.tolist() == [reference_sample(logits, params, u) for u in us]
