"""The router's top-k choice of experts: softmax, sigmoid or sqrt-softplus scores, DeepSeek-V3's bias and groups."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from colibri.runtime.kernels.threads import part_range, thread_count

F32 = np.float32
_njit = njit(cache=True, nogil=True)
PARALLEL_ROUTE_ROWS = 16  # rows from which `route` shares them between threads (each row's choice is its own)
SOFTMAX, SIGMOID, SQRT_SOFTPLUS = 0, 1, 2  # RouteRule.scoring
SCORINGS = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "sqrtsoftplus": SQRT_SOFTPLUS}  # ModelConfig.router -> scoring
SOFTPLUS_LINEAR = F32(20.0)  # softplus(x) is x from here on, as torch computes it


class RouteRule(NamedTuple):
    """How a router scores and chooses (see `route`)."""

    scoring: int  # SOFTMAX, SIGMOID or SQRT_SOFTPLUS
    groups: int
    topk_groups: int
    top2_sum: bool
    norm: bool
    scale: np.float32


@_njit
def _score_into(row, scoring, scores):
    """The scores of one row of router logits."""
    if scoring == SIGMOID:
        for e in range(row.size):
            scores[e] = F32(1.0) / (F32(1.0) + np.exp(-row[e]))
    elif scoring == SQRT_SOFTPLUS:
        for e in range(row.size):
            x = row[e]
            scores[e] = np.sqrt(x if x > SOFTPLUS_LINEAR else np.log1p(np.exp(x)))
    else:
        top, total = row.max(), F32(0.0)
        for e in range(row.size):
            scores[e] = np.exp(row[e] - top)
            total += scores[e]
        for e in range(row.size):
            scores[e] = scores[e] / total


@_njit
def _weigh(weights, total, rule):
    """The chosen scores of one row, renormalized (plus 1e-20 unless softmax) and scaled, in place."""
    for j in range(weights.size):
        if rule.norm:
            weights[j] = weights[j] / (total + (F32(1e-20) if rule.scoring != SOFTMAX else F32(0.0)))
        weights[j] = weights[j] * rule.scale


@_njit
def route_into(logits, bias, rule, ids, weights):
    """`route` into ids int64 [n, k] and weights float32 [n, k] (bias: float32 [experts])."""
    scoring, groups, topk_groups, top2_sum, norm, scale = rule
    n, experts = logits.shape
    k, per_group = ids.shape[1], experts // groups
    scores, choice = np.empty(experts, np.float32), np.empty(experts, np.float32)
    group_scores = np.empty(groups, np.float32)
    for i in range(n):
        _score_into(logits[i], scoring, scores)
        for e in range(experts):
            choice[e] = scores[e] + bias[e]
        if groups > 1:
            for g in range(groups):
                part = choice[g * per_group:(g + 1) * per_group]
                first = np.argmax(part)
                if top2_sum:
                    second = F32(-np.inf) if per_group > 1 else F32(0.0)
                    for e in range(per_group):
                        if e != first and part[e] > second:
                            second = part[e]
                    group_scores[g] = second + part[first]
                else:
                    group_scores[g] = part[first]
            for _ in range(topk_groups):  # the kept groups' scores become +inf
                group_scores[np.argmax(np.where(group_scores == np.inf, -np.inf, group_scores))] = np.inf
            for g in range(groups):
                if group_scores[g] != np.inf:
                    choice[g * per_group:(g + 1) * per_group] = -np.inf
        total = F32(0.0)
        for j in range(k):  # the highest choice first; of equal ones, the lowest id
            e = np.argmax(choice)
            ids[i, j], weights[i, j] = e, scores[e]
            choice[e] = -np.inf
            total += scores[e]
        _weigh(weights[i], total, rule)


@_njit
def weigh_chosen_into(logits, rule, ids, weights):
    """The weights float32 [n, k] of experts chosen otherwise (ids int64 [n, k], a hash layer's
    table): their scores, renormalized and scaled as `route_into` weighs its choice."""
    scores = np.empty(logits.shape[1], np.float32)
    for i in range(logits.shape[0]):
        _score_into(logits[i], rule.scoring, scores)
        total = F32(0.0)
        for j in range(ids.shape[1]):
            weights[i, j] = scores[ids[i, j]]
            total += weights[i, j]
        _weigh(weights[i], total, rule)


@njit(cache=True, nogil=True, parallel=True)
def _route_parallel(logits, bias, rule, ids, weights, nthreads):
    """`route_into` on all threads, each taking a share of the rows."""
    for t in prange(nthreads):
        lo, hi = part_range(logits.shape[0], nthreads, t, 1)
        route_into(logits[lo:hi], bias, rule, ids[lo:hi], weights[lo:hi])


def route(logits: np.ndarray, bias: np.ndarray | None, k: int, sigmoid: bool = False, groups: int = 1,
          topk_groups: int = 1, top2_sum: bool = True, norm: bool = False, scale: float = 1.0,
          scoring: int | None = None):
    """The k experts each row of router logits [n, experts] picks -> (ids int64 [n, k],
    weights float32 [n, k]). Scores are the softmax, sigmoid or sqrt(softplus) of the logits; the choice
    adds `bias` (DeepSeek-V3's correction) and, with `groups` > 1, keeps only the experts of
    the `topk_groups` groups that score best (sum of their top two choices, or the max);
    weights are the chosen scores, renormalized to sum 1 when `norm`, times `scale`. `scoring`
    (SCORINGS' values), when given, overrides `sigmoid`."""
    scoring = (SIGMOID if sigmoid else SOFTMAX) if scoring is None else scoring
    return route_by(logits, bias, k, RouteRule(scoring, groups, topk_groups, top2_sum, norm, F32(scale)))


def route_by(logits: np.ndarray, bias: np.ndarray | None, k: int, rule: RouteRule):
    """`route` with its scoring and choice given as a `RouteRule`."""
    n, experts = logits.shape
    ids, weights = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
    bias = np.zeros(experts, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    args = (np.ascontiguousarray(logits, dtype=np.float32), bias, rule, ids, weights)
    if n >= PARALLEL_ROUTE_ROWS:
        _route_parallel(*args, thread_count())
    else:
        route_into(*args)
    return ids, weights


def weigh_chosen(logits: np.ndarray, ids: np.ndarray, rule: RouteRule) -> np.ndarray:
    """The weights [n, k] of the experts `ids` [n, k] a table chose for rows of router logits
    [n, experts] (`weigh_chosen_into`)."""
    weights = np.empty(ids.shape, np.float32)
    weigh_chosen_into(np.ascontiguousarray(logits, dtype=np.float32), rule, np.ascontiguousarray(ids, dtype=np.int64),
                      weights)
    return weights
