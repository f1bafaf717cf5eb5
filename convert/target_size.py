"""`--target-size`: each tensor's type chosen, from the grid types and the K-quants, for the least
measured damage within a budget of file bytes (and, optionally, of expert bytes read a token).

Damage is measured, not assumed. For every tensor and candidate type a sample of the tensor's
rows is quantized and decoded again; its error, weighted per column by the importance matrix
(the mean squared activation entering that column, so the error is the squared error the
tensor adds to its output a token), is scaled to all of the tensor's rows and to how often it
is used: every token for a dense tensor, an expert's share of the routed tokens for an expert
(from the importance matrix's counts; without one, top-k / experts each). The token
embeddings add one row a token. Without an importance matrix every column weighs the same,
and the grid types that need one are not candidates.

The choice is a knapsack over those measurements: every tensor starts at its cheapest type and
the upgrade that removes the most damage a byte is taken while it fits, along each tensor's
lower convex hull of (bytes, damage). Page and row alignment are counted by computing the files'
real size and shrinking the budget by the excess (or by the alignment the table needed, when
that is more), a few rounds at most.

With a scorer (`--kl-base`), the measured error's blind spot is checked through the model itself:
how much a kind of tensor's error costs at the logits differs by kind (attention, the experts'
gate/up and down, dense FFNs, embeddings and output). `refine` weighs each kind's damage up or
down by steps of CLASS_STEP in turn, makes the table each weighting fits, and keeps a weighting
only when the scorer (the mean KL divergence of that table's conversion from a base, on
calibration text) finds it lower.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from colibri.convert.quantize_q4k import dequantize, quantize
from colibri.formats.encodings import fits, row_bytes
from colibri.formats.recipe import IMATRIX_TYPES

CANDIDATES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "Q2_K", "Q3_K", "IQ4_XS", "Q4_K",
              "Q5_K", "Q6_K", "Q8_0")
SAMPLE_WEIGHTS = 1 << 18  # about this many weights of each tensor are quantized per candidate
BUDGET_ROUNDS = 6
CLASS_STEP = 4.0  # refine weighs each kind's damage up and down by this
MAX_STEPS = 3  # steps of CLASS_STEP one way for one kind
MAX_TABLES = 12  # tables refine scores at most, unless told (`--kl-tables`)


@dataclass
class Choice:
    """One tensor to type: its canonical name, its candidates' (type, bytes, damage) and
    whether it is an expert tensor (read per token)."""

    name: str
    options: list[tuple[str, int, float]]
    expert: bool = False
    hull: list[tuple[str, int, float]] = field(init=False)

    def __post_init__(self):
        self.hull = lower_hull(self.options)


def lower_hull(options: list[tuple[str, int, float]]) -> list[tuple[str, int, float]]:
    """The options no mix of two others beats: by bytes, each less damage, at a falling rate."""
    kept = []
    for option in sorted(options, key=lambda o: (o[1], o[2])):
        if kept and option[2] >= kept[-1][2]:
            continue
        while len(kept) >= 2 and _rate(kept[-2], kept[-1]) <= _rate(kept[-1], option):
            kept.pop()
        kept.append(option)
    return kept


def _rate(cheaper, dearer) -> float:
    """Damage removed a byte going from `cheaper` to `dearer`."""
    return (cheaper[2] - dearer[2]) / max(dearer[1] - cheaper[1], 1)


def sample_rows(rows: int, cols: int) -> np.ndarray:
    """Evenly spaced row indices, about SAMPLE_WEIGHTS weights' worth."""
    n = min(rows, max(16, SAMPLE_WEIGHTS // cols))
    return np.unique(np.linspace(0, rows - 1, n).astype(np.int64))


def squared_error(values: np.ndarray, encoding: str, importance: np.ndarray | None) -> float:
    """Σ over rows and columns of importance · (value − decoded value)² after quantizing to `encoding`."""
    decoded = dequantize(quantize(values, encoding, importance), encoding, values.shape[-1])
    error = (values.astype(np.float64) - decoded) ** 2
    return float((error * (importance if importance is not None else 1.0)).sum())


def candidates(cols: int, has_importance: bool) -> list[str]:
    return [e for e in CANDIDATES if fits(e, cols) and (has_importance or e not in IMATRIX_TYPES)]


def measure(name: str, samples: list[tuple[np.ndarray, np.ndarray | None, float]], rows: int, count: int,
            expert: bool) -> Choice:
    """A tensor's choice from `samples` = [(sampled rows, column importance or None, uses a token
    of the whole tensor's rows)]; `count` matrices of `rows` rows (the experts of a layer, or 1)."""
    cols = samples[0][0].shape[-1]
    has_importance = all(importance is not None for _, importance, _ in samples)
    options = []
    for encoding in candidates(cols, has_importance):
        damage = sum(uses * rows / len(values) * squared_error(values, encoding, importance)
                     for values, importance, uses in samples)
        options.append((encoding, count * rows * row_bytes(encoding, cols), damage))
    return Choice(name, options, expert)


def choose(choices: list[Choice], budget: int, read_budget: int | None = None, top_k: int = 1,
           experts: int = 1) -> dict[str, str]:
    """Each choice's type: the least total damage whose bytes fit `budget` (and whose expert
    bytes a token, top_k / experts of the expert tensors' bytes, fit `read_budget`)."""
    at = [0] * len(choices)
    spent = sum(c.hull[0][1] for c in choices)
    read = sum(c.hull[0][1] for c in choices if c.expert) * top_k // experts
    if spent > budget or (read_budget is not None and read > read_budget):
        raise ValueError("even the smallest types exceed it")
    upgrades = [(-_rate(c.hull[0], c.hull[1]), i) for i, c in enumerate(choices) if len(c.hull) > 1]
    heapq.heapify(upgrades)
    while upgrades:
        _, i = heapq.heappop(upgrades)
        c, k = choices[i], at[i]
        more = c.hull[k + 1][1] - c.hull[k][1]
        more_read = more * top_k // experts if c.expert else 0
        if spent + more > budget or (read_budget is not None and read + more_read > read_budget):
            continue
        at[i], spent, read = k + 1, spent + more, read + more_read
        if k + 2 < len(c.hull):
            heapq.heappush(upgrades, (-_rate(c.hull[k + 1], c.hull[k + 2]), i))
    return {c.name: c.hull[k][0] for c, k in zip(choices, at)}


def measure_all(tensors, progress: bool = True) -> list[Choice]:
    """`tensors`: (name, rows, count, expert, sampler) with sampler() → samples as `measure` takes."""
    bar = tqdm(tensors, desc="measuring types", unit="tensor", disable=not progress, dynamic_ncols=True)
    return [measure(name, sampler(), rows, count, expert) for name, rows, count, expert, sampler in bar]


def fit_to_size(choices: list[Choice], target: int, sizes_of, read_target: int | None, top_k: int,
                experts: int) -> dict[str, str]:
    """`choose` with the budgets shrunk until the real sizes (`sizes_of(table)` = (file bytes,
    expert bytes read a token), alignment included) fit `target` and `read_target`:
    each round by the overshoot, or at once by the alignment the last table needed, whichever is more."""
    budget, read_budget = target, read_target
    for _ in range(BUDGET_ROUNDS):
        table = choose(choices, budget, read_budget, top_k, experts)
        raw = sum(_bytes_of(c, table) for c in choices)
        raw_read = sum(_bytes_of(c, table) for c in choices if c.expert) * top_k // experts
        size, read = sizes_of(table)
        if size <= target and (read_target is None or read <= read_target):
            return table
        budget = min(budget - max(size - target, 0), target - (size - raw)) if size > target else budget
        if read_target is not None and read > read_target:
            read_budget = min(read_budget - (read - read_target), read_target - (read - raw_read))
    raise ValueError("alignment keeps the files above it")


def tensor_class(name: str) -> str:
    """The kind of tensor whose damage `refine` weighs as one."""
    if name in ("token_embd.weight", "output.weight"):
        return "embeddings/output"
    kind = re.sub(r"^blk\.\d+\.", "", name)
    if kind.startswith("attn"):
        return "attention"
    if "_exps" in kind:
        return "expert down" if kind.startswith("ffn_down") else "expert gate/up"
    return "dense ffn"


def weighted(choices: list[Choice], weights: dict[str, float]) -> list[Choice]:
    """`choices` with each kind's damage scaled by its weight (1 when not given)."""
    return [Choice(c.name, [(e, b, d * weights.get(tensor_class(c.name), 1.0)) for e, b, d in c.options], c.expert)
            for c in choices]


@dataclass
class Trial:
    """One table `refine` scored: the kinds' weights that made it, and its score."""

    weights: dict[str, float]
    score: float
    kept: bool


def refine(choices: list[Choice], fit, score, max_tables: int = MAX_TABLES) -> tuple[dict[str, str], list[Trial]]:
    """The table of least `score(table)` that `fit(choices) → table` makes over kinds' weightings.
    From the measured damage as it is, each kind's weight in turn is multiplied by CLASS_STEP
    while that scores lower, else divided by it while that does; a weighting that makes the
    same table is passed through unscored. At most `max_tables` tables are scored."""
    weights: dict[str, float] = {}
    table = fit(choices)
    best = score(table)
    trials, seen = [Trial({}, best, True)], [table]
    for kind in sorted({tensor_class(c.name) for c in choices}):
        for factor in (CLASS_STEP, 1 / CLASS_STEP):
            moved, trial = False, weights
            for _ in range(MAX_STEPS):
                trial = {**trial, kind: trial.get(kind, 1.0) * factor}
                candidate = fit(weighted(choices, trial))
                if candidate == table:
                    continue
                if candidate in seen or len(trials) >= max_tables:
                    break
                seen.append(candidate)
                result = score(candidate)
                trials.append(Trial(trial, result, result < best))
                if result >= best:
                    break
                table, best, weights, moved = candidate, result, trial, True
            if moved:
                break
    return table, trials


def _bytes_of(choice: Choice, table: dict[str, str]) -> int:
    return next(b for encoding, b, _ in choice.options if encoding == table[choice.name])


def type_runs(table: dict[str, str]) -> list[str]:
    """The chosen table for people: per kind of tensor, its types over runs of layers
    ("ffn_down_exps  L0-1 Q4_K, L2-31 IQ2_XS")."""
    kinds: dict[str, list[tuple[int, str]]] = {}
    for name, encoding in table.items():
        match = re.match(r"blk\.(\d+)\.(.*)", name)
        layer, kind = (int(match.group(1)), match.group(2)) if match else (-1, name)
        kinds.setdefault(kind.removesuffix(".weight"), []).append((layer, encoding))
    lines = []
    for kind, layers in sorted(kinds.items()):
        runs: list[list] = []
        for layer, encoding in sorted(layers):
            if runs and runs[-1][2] == encoding and runs[-1][1] == layer - 1:
                runs[-1][1] = layer
            else:
                runs.append([layer, layer, encoding])
        lines.append(f"{kind:<20} " + ", ".join(
            encoding if first < 0 else f"L{first}{'' if last == first else f'-{last}'} {encoding}" for first, last, encoding in runs))
    return lines
