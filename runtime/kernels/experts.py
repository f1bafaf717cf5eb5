"""The routed experts of a layer: `ExpertKernel`, its checked wrappers, and the weighted sum.

A decoded token goes through its k experts in one parallel call (gate and up rows of all of
them at once, then the down rows). Many rows (a prompt chunk) go through all of a layer's
(expert, rows) groups in one call (`ExpertKernel.grouped`), each expert's outputs added to its
rows' sums in expert order; `ExpertKernel.batch` is the same for one expert, and what the
rows take when they are multiplied on AMX tiles or exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from colibri.formats.encodings import row_bytes
from colibri.runtime import amx
from colibri.runtime.kernels.activations import (
    WIDEST_ACT_BLOCK, activation_row, activation_rows, dot_type_for, empty_activation, fill_activation, float_rows,
    lanes_in_force, make_activation,
)
from colibri.runtime.kernels.blocks import BLOCK_TAGS
from colibri.runtime.kernels.matrices import matrix_times
from colibri.runtime.kernels.numerics import GLU, GLU_KINDS, SILU, glu
from colibri.runtime.kernels.rows import GROUP, row_dot, rows_times
from colibri.runtime.kernels.threads import part_range, thread_count

F32 = np.float32
_njit = njit(cache=True, nogil=True)
_parallel = njit(cache=True, nogil=True, parallel=True)
GROUPED_ROW_BYTES = 32 << 20  # the products one call of the grouped kernel holds (its rows x hidden, float32)


class ExpertsRule(NamedTuple):
    """What the expert kernels take of a layer's routed experts, checked once by `ExpertKernel`:
    each matrix's block tag, byte offset in an expert's record and bytes per row (gate and up
    [ffn, hidden], down [hidden, ffn]), the GLU (`GLU_KINDS`, its alpha and limit) and the
    biases (gate, up [experts, ffn], down [experts, hidden]; 0 rows: none). Flat, for numba's
    parallel regions."""

    gate_tag: np.dtype
    up_tag: np.dtype
    down_tag: np.dtype
    gate_at: int
    up_at: int
    down_at: int
    gate_row: int
    up_row: int
    down_row: int
    ffn: int
    hidden: int
    glu: int
    alpha: np.float32
    limit: np.float32
    gate_bias: np.ndarray
    up_bias: np.ndarray
    down_bias: np.ndarray


class Choice(NamedTuple):
    """A token's k experts: their rows of the records (`slots`), their ids, their weights."""

    slots: np.ndarray
    ids: np.ndarray
    weights: np.ndarray


class Groups(NamedTuple):
    """Many rows' experts grouped: group g is expert ids[g] in records[slots[g]], applied to
    batch rows rows[starts[g]:starts[g + 1]] with those rows' routing `weights`; `ys`, float32
    [at least starts[-1], hidden], takes their products before they are added up."""

    slots: np.ndarray
    starts: np.ndarray
    rows: np.ndarray
    weights: np.ndarray
    ids: np.ndarray
    ys: np.ndarray


class ExpertScratch(NamedTuple):
    """A decoded token's buffers for its k experts: x's activations for the gate and the up
    rows (the same one unless `up_distinct`), the gate and up products [2, k, ffn] (the GLU
    is written over the gate's), and the GLU's activation for the down rows."""

    gate_act: object
    up_act: object
    up_distinct: bool
    gate_up: np.ndarray
    h_act: object


@_parallel
def _expert_hidden(rule, records, choice, gate_act, up_act, gate_up, h_act, nthreads):
    """gate_up[0, j, i] = glu(gate_j[i] . x, up_j[i] . x) (+ biases) over all k * ffn rows at
    once; each thread then quantizes its own (256-aligned) part for the down rows."""
    k, ffn, hidden = choice.slots.shape[0], rule.ffn, rule.hidden
    slots, ids, gate_bias, up_bias = choice.slots, choice.ids, rule.gate_bias, rule.up_bias
    gate_tag, up_tag, gate_at, up_at, gate_row, up_row = rule.gate_tag, rule.up_tag, rule.gate_at, rule.up_at, \
        rule.gate_row, rule.up_row
    kind, alpha, limit = rule.glu, rule.alpha, rule.limit
    biased = gate_bias.shape[0] > 0
    gates, ups = gate_up[0].reshape(-1), gate_up[1].reshape(-1)
    for t in prange(nthreads):
        first, stop = part_range(k * ffn, nthreads, t, WIDEST_ACT_BLOCK)
        gate_x, up_x = activation_row(gate_act, 0), activation_row(up_act, 0)
        for index in range(first, stop):
            j, i = index // ffn, index % ffn
            record = records[slots[j]]
            gates[index] = row_dot(gate_tag, record, gate_at + i * gate_row, hidden, gate_x)
            ups[index] = row_dot(up_tag, record, up_at + i * up_row, hidden, up_x)
        if biased:
            for index in range(first, stop):
                j, i = index // ffn, index % ffn
                gates[index] += gate_bias[ids[j], i]
                ups[index] += up_bias[ids[j], i]
        for index in range(first, stop):  # a loop of its own, which vectorizes (in the dots' loop it did not)
            gates[index] = glu(gates[index], ups[index], kind, alpha, limit)
        fill_activation(h_act, gate_up[0], first, stop)


@_parallel
def _expert_down(rule, records, choice, h_act, out, nthreads):
    """out[r] = sum_j weights[j] * (down_j[r] . h[j] (+ its bias)), one expert's rows at a time."""
    k, ffn, hidden = choice.slots.shape[0], rule.ffn, rule.hidden
    slots, ids, weights, down_bias = choice.slots, choice.ids, choice.weights, rule.down_bias
    down_tag, down_at, down_row = rule.down_tag, rule.down_at, rule.down_row
    biased = down_bias.shape[0] > 0
    for t in prange(nthreads):
        first, stop = part_range(hidden, nthreads, t, 1)
        out[first:stop] = 0.0
        for j in range(k):
            act = activation_row(h_act, j)
            record = records[slots[j]]
            for r in range(first, stop):
                y = row_dot(down_tag, record, down_at + r * down_row, ffn, act)
                out[r] += weights[j] * (y + down_bias[ids[j], r] if biased else y)


@_njit
def moe_steps(rule, records, choice, scratch, x, out, nthreads):
    """The k experts of `choice` for one token x [1, hidden] into out [hidden]: x quantized
    for the gate and (when its dot type differs) the up rows, then `_expert_hidden`, then
    `_expert_down`. The one-token kernel, and the experts of `fused`'s layer tail."""
    fill_activation(scratch.gate_act, x, 0, rule.hidden)
    if scratch.up_distinct:
        fill_activation(scratch.up_act, x, 0, rule.hidden)
    _expert_hidden(rule, records, choice, scratch.gate_act, scratch.up_act, scratch.gate_up, scratch.h_act, nthreads)
    _expert_down(rule, records, choice, scratch.h_act, out, nthreads)


@njit(cache=True, nogil=True, fastmath=True)
def glu_rows(gate, up, first, stop, kind, alpha, limit):
    """gate[i] <- glu(gate[i], up[i]) for rows first..stop-1 ([n, ffn] each)."""
    for i in range(first, stop):
        g, u = gate[i], up[i]
        for j in range(g.size):
            g[j] = glu(g[j], u[j], kind, alpha, limit)


@_parallel
def _glu(gate, up, kind, alpha, limit, nthreads):
    """gate <- glu(gate, up), elementwise ([n, ffn] each)."""
    for t in prange(nthreads):
        first, stop = part_range(gate.shape[0], nthreads, t, 1)
        glu_rows(gate, up, first, stop, kind, alpha, limit)
    return gate


def glu_times(gate: np.ndarray, up: np.ndarray, rule: GLU = SILU) -> np.ndarray:
    """gate <- glu(gate, up) (float32 [n, ffn] each, C-contiguous; `rule` a `GLU`, silu(gate) * up
    unless given), the gated activation of the dense FFNs and shared experts with the arithmetic
    of the expert kernels; returns gate."""
    return _glu(gate, up, rule.kind, rule.alpha, rule.limit, thread_count())


@_njit
def _split_row(starts, row):
    """Row `row` of the groups' concatenation moved to a whole number of GROUP rows from its
    group's start (or to the group's end): where one thread's share of the rows ends and the
    next one's begins, so a group cut between threads leaves no extra partial GROUP."""
    g = np.searchsorted(starts, row, side="right") - 1
    if g >= starts.size - 1:
        return starts[-1]
    return min(starts[g] + (row - starts[g] + GROUP // 2) // GROUP * GROUP, starts[g + 1])


@_parallel
def _grouped_kernel(rule, records, groups, gate_act, up_act, h_act, out, parts):
    """For each of the `groups` (expert ids[g] in record slots[g], rows rows[starts[g]:starts[g+1]]
    of the batch): out[rows] += weights * down(glu(gate @ x, up @ x)). The groups' rows, in
    order, are cut into `parts` equal shares run in parallel (a group may be cut between two:
    a few experts often take most rows), each with the kernels `batch` uses (a product's
    values do not depend on how its rows are split); the outputs are then added in group order."""
    slots, starts, rows, ids = groups.slots, groups.starts, groups.rows, groups.ids
    ffn, hidden, biased = rule.ffn, rule.hidden, rule.gate_bias.shape[0] > 0
    gate_bias, up_bias, down_bias = rule.gate_bias, rule.up_bias, rule.down_bias
    gate_tag, up_tag, down_tag = rule.gate_tag, rule.up_tag, rule.down_tag
    gate_at, up_at, down_at, gate_row, up_row, down_row = rule.gate_at, rule.up_at, rule.down_at, rule.gate_row, \
        rule.up_row, rule.down_row
    kind, alpha, limit = rule.glu, rule.alpha, rule.limit
    ys = groups.ys
    for part in prange(parts):
        first = _split_row(starts, starts[-1] * part // parts)
        stop = _split_row(starts, starts[-1] * (part + 1) // parts)
        g = np.searchsorted(starts, first, side="right") - 1
        while first < stop:
            end = min(stop, starts[g + 1])
            mine = rows[first:end]
            n, record = mine.size, records[slots[g]]
            gate = np.empty((n, ffn), np.float32)
            up = np.empty((n, ffn), np.float32)
            rows_times(gate_tag, record[gate_at:], 0, ffn, gate_row, hidden, activation_row(gate_act, mine), gate)
            rows_times(up_tag, record[up_at:], 0, ffn, up_row, hidden, activation_row(up_act, mine), up)
            if biased:
                gate += gate_bias[ids[g]]
                up += up_bias[ids[g]]
            glu_rows(gate, up, 0, n, kind, alpha, limit)
            mine_h = activation_row(h_act, slice(first, end))
            fill_activation(mine_h, gate, 0, gate.size)
            y = ys[first:end]
            rows_times(down_tag, record[down_at:], 0, hidden, down_row, ffn, mine_h, y)
            if biased:
                y += down_bias[ids[g]]
            first, g = end, g + 1
    add_weighted_rows(out, rows, ys[:starts[-1]], groups.weights)


class ExpertKernel:
    """sum_j weights[j] * down_j(glu(gate_j @ x, up_j @ x)) for the k routed experts of one
    layer in one call (decode); encodings, offsets and sizes are checked once, here.

    An expert is a row of `records` (uint8 [m, record_bytes]) with gate [ffn, hidden], up
    [ffn, hidden] and down [hidden, ffn] at byte `offsets` in `encodings`. With int8
    activations (exact=False), x is quantized once for every gate and up, and each expert's
    hidden state once for its down. `glu` is a key of GLU_KINDS (its alpha and limit for
    "clamped_swiglu"); `biases` (gate [experts, ffn], up [experts, ffn], down [experts,
    hidden], float32) are added to each expert's products, found by expert id."""

    def __init__(self, record_bytes: int, encodings: tuple[str, str, str], offsets: tuple[int, int, int], ffn: int,
                 hidden: int, exact: bool = False, glu: str = "silu", alpha: float = 1.0, limit: float = 0.0,
                 biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None):
        shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
        self.sizes = tuple(row_bytes(encoding, cols) for encoding, (_, cols) in zip(encodings, shapes))
        for name, offset, (rows, _), size in zip(("gate", "up", "down"), offsets, shapes, self.sizes):
            if offset < 0 or offset + rows * size > record_bytes:
                raise ValueError(f"{name} [{rows} rows of {size} bytes] at offset {offset} does not fit "
                                 f"in a record of {record_bytes} bytes")
        self.record_bytes, self.ffn, self.hidden = record_bytes, ffn, hidden
        self.dot_types = tuple(dot_type_for(encoding, exact) for encoding in encodings)
        self.decode_buffers: tuple | None = None  # a decoded token's activations and products, kept for the next
        if biases is None:
            biases = tuple(np.zeros((0, cols), F32) for cols in (ffn, ffn, hidden))
        for name, bias, cols in zip(("gate", "up", "down"), biases, (ffn, ffn, hidden)):
            if bias.dtype != F32 or bias.ndim != 2 or bias.shape[1] != cols or not bias.flags.c_contiguous:
                raise ValueError(f"{name} bias must be C-contiguous float32 [experts, {cols}], got {bias.dtype} {bias.shape}")
        self.biases = tuple(biases)
        self.rule = ExpertsRule(*(BLOCK_TAGS[encoding] for encoding in encodings), *(int(o) for o in offsets),
                                *self.sizes, ffn, hidden, GLU_KINDS[glu], F32(alpha), F32(limit), *self.biases)

    def activations(self, x: np.ndarray) -> dict:
        """x float32 [n, hidden] as the gate and the up kernels take it (by dot type: quantized
        once when they share one), for `batch`; quantize a layer's tokens once for all its experts."""
        return {dot_type: make_activation(x, dot_type) for dot_type in set(self.dot_types[:2])}

    @staticmethod
    def rows_of(acts: dict, rows: np.ndarray) -> dict:
        """The activations of tokens `rows` (an index array) of `activations`' result."""
        return {dot_type: activation_rows(act, rows) for dot_type, act in acts.items()}

    def __call__(self, records: np.ndarray, slots: np.ndarray, x: np.ndarray, weights: np.ndarray,
                 ids: np.ndarray) -> np.ndarray:
        """records uint8 [m, >= record_bytes] (C-contiguous, e.g. a cache slab used in place),
        slots int64 [k] (the rows of experts `ids`), x float32 [hidden], weights float32 [k] ->
        float32 [hidden]."""
        row = x.reshape(1, self.hidden)
        out = np.empty(self.hidden, np.float32)
        choice = Choice(slots, self._bias_ids(ids), weights)
        moe_steps(self.rule, records, choice, self.scratch(row, slots.shape[0]), row, out, thread_count())
        return out

    def scratch(self, row: np.ndarray, k: int) -> ExpertScratch:
        """The one-token kernel's buffers for row [1, hidden] and k experts (the float path
        reads `row` itself), multiplied with float lanes; the arrays are kept for the next token."""
        if self.decode_buffers is None or self.decode_buffers[1].shape[1] != k:
            acts = {dot_type: None if dot_type is None else empty_activation(1, self.hidden, dot_type, lanes=True)
                    for dot_type in self.dot_types[:2]}
            gate_up = np.empty((2, k, self.ffn), np.float32)
            h_act = gate_up[0] if self.dot_types[2] is None else \
                empty_activation(k, self.ffn, self.dot_types[2], lanes=True)
            self.decode_buffers = acts, gate_up, h_act
        acts, gate_up, h_act = self.decode_buffers
        gate_act, up_act = (row if acts[dot_type] is None else acts[dot_type] for dot_type in self.dot_types[:2])
        return ExpertScratch(gate_act, up_act, self.dot_types[0] != self.dot_types[1], gate_up, h_act)

    def _bias_ids(self, ids: np.ndarray) -> np.ndarray:
        """ids as the kernels index the biases, each checked against their rows."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if self.biases[0].shape[0] and ids.size and not 0 <= ids.min() <= ids.max() < self.biases[0].shape[0]:
            raise ValueError(f"expert ids {ids.tolist()} out of range for {self.biases[0].shape[0]} experts' biases")
        return ids

    def batch(self, record: np.ndarray, acts: dict, n: int, expert: int) -> np.ndarray:
        """Expert `expert` (its record, contiguous uint8 [>= record_bytes]) applied to each of n
        tokens, given as `activations` of them -> float32 [n, hidden], without a routing
        weight (prefill)."""
        gate, up = (self._project(record, m, self.ffn, self.hidden, acts[dot_type], n)
                    for m, dot_type in enumerate(self.dot_types[:2]))
        biased = self.biases[0].shape[0] > 0
        if biased:
            expert = int(self._bias_ids(np.array([expert]))[0])
            gate += self.biases[0][expert]
            up += self.biases[1][expert]
        h = _glu(gate, up, self.rule.glu, self.rule.alpha, self.rule.limit, thread_count())
        y = self._project(record, 2, self.hidden, self.ffn, make_activation(h, self.dot_types[2]), n)
        return y + self.biases[2][expert] if biased else y

    def groupable(self, acts: dict) -> bool:
        """Whether `activations` are int8 ones, which `grouped` takes (AMX tiles and the exact
        path go expert by expert through `batch`)."""
        return None not in self.dot_types and not any(isinstance(a, amx.TileActivation) for a in acts.values())

    def grouped(self, records: np.ndarray, slots: np.ndarray, starts: np.ndarray, rows: np.ndarray,
                weights: np.ndarray, acts: dict, out: np.ndarray, ids: np.ndarray, parts: int | None = None) -> None:
        """Every group g (expert ids[g] in `records[slots[g]]`, batch rows `rows[starts[g]:starts[g+1]]`
        with their routing weights) in one call, each added to `out` [n, hidden] in order: what
        `batch` and `add_weighted_rows` give group by group. `acts` from `activations` of the
        whole batch, `groupable`. The rows are shared out in `parts` (default: the thread count),
        GROUPED_ROW_BYTES of their products at a time: the products' and hidden states' buffers
        stay that size however many rows a prompt pass brings (the same sums, added to `out` in
        the same order)."""
        gate_act, up_act = (acts[dot_type] for dot_type in self.dot_types[:2])
        chunk = min(rows.size, max(GROUPED_ROW_BYTES // (4 * self.hidden), GROUP))
        # each group quantizes its own rows
        h_act = empty_activation(chunk, self.ffn, self.dot_types[2], lanes_in_force())
        ys, bias_ids = np.empty((chunk, self.hidden), F32), self._bias_ids(ids)
        parts = thread_count() if parts is None else parts
        for first in range(0, rows.size, chunk):
            stop = min(first + chunk, rows.size)
            g0, g1 = np.searchsorted(starts, first, side="right") - 1, np.searchsorted(starts, stop, side="left")
            cut = (np.clip(starts[g0:g1 + 1], first, stop) - first).astype(np.int64)
            groups = Groups(slots[g0:g1], cut, rows[first:stop], weights[first:stop], bias_ids[g0:g1], ys)
            _grouped_kernel(self.rule, records, groups, gate_act, up_act, h_act, out, parts)

    def _project(self, record: np.ndarray, m: int, rows: int, cols: int, act, n: int) -> np.ndarray:
        tag, offset = self.rule[m], self.rule[3 + m]  # the rule's tags, then its offsets
        return matrix_times(tag, record[offset:], rows, cols, self.sizes[m], act, n)


def moe_experts(records: np.ndarray, encodings: tuple[str, str, str], offsets: tuple[int, int, int], ffn: int,
                hidden: int, x: np.ndarray, weights: np.ndarray, exact: bool = False,
                slots: np.ndarray | None = None, ids: np.ndarray | None = None, **activation) -> np.ndarray:
    """`ExpertKernel` on experts `slots` of `records` (default: all of its rows), which are
    experts `ids` (default: `slots`), with checks of every argument: x float32 [hidden],
    weights float32 [k] -> float32 [hidden]. `activation`: ExpertKernel's glu, alpha, limit, biases."""
    if records.dtype != np.uint8 or records.ndim != 2 or not records.flags.c_contiguous:
        raise ValueError(f"records must be C-contiguous uint8 [m, record_bytes], got {records.dtype} {records.shape}")
    slots = np.arange(records.shape[0]) if slots is None else np.asarray(slots, dtype=np.int64).reshape(-1)
    if slots.size and (slots.min() < 0 or slots.max() >= records.shape[0]):
        raise ValueError(f"slots {slots.tolist()} out of range for {records.shape[0]} records")
    weights = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
    if weights.shape != slots.shape:
        raise ValueError(f"weights must have shape ({slots.shape[0]},), got {weights.shape}")
    x = float_rows(np.asarray(x).reshape(1, -1), hidden)[0]
    ids = slots if ids is None else np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.shape != slots.shape:
        raise ValueError(f"ids must have shape ({slots.shape[0]},), got {ids.shape}")
    return ExpertKernel(records.shape[1], encodings, offsets, ffn, hidden, exact, **activation)(records, slots, x,
                                                                                                weights, ids)


def moe_experts_batch(record: np.ndarray, encodings: tuple[str, str, str], offsets: tuple[int, int, int],
                      ffn: int, hidden: int, x: np.ndarray, exact: bool = False, expert: int = 0,
                      **activation) -> np.ndarray:
    """`ExpertKernel.batch` with checks of every argument: one expert (`record`, its bytes as a
    row of moe_experts') applied to each row of x float32 [n, hidden] -> float32 [n, hidden]."""
    record = np.ascontiguousarray(record).reshape(-1)
    if record.dtype != np.uint8:
        raise ValueError(f"record must be uint8 bytes, got {record.dtype}")
    kernel = ExpertKernel(record.size, encodings, offsets, ffn, hidden, exact, **activation)
    return kernel.batch(record, kernel.activations(float_rows(x, hidden)), x.shape[0], expert)


@_njit
def add_weighted_rows(out: np.ndarray, rows: np.ndarray, y: np.ndarray, weights: np.ndarray) -> None:
    """out[rows[i]] += weights[i] * y[i] for each i, in order: experts' outputs added to their
    tokens' sums."""
    for i in range(rows.size):
        target, source, weight = out[rows[i]], y[i], weights[i]
        for j in range(source.size):
            target[j] += weight * source[j]
