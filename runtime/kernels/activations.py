"""The activations the kernels multiply weights with, and the int8 quantization that makes them.

An activation is a float32 array (exact path), a `Q8_0Activation` / `Q8_KActivation` named
tuple of int8 levels, scales and scaled sums (fast path; numba tells them apart by type) or an
`amx.TileActivation` (tiles). One quantized activation serves every matrix of its dot type
that multiplies it (q, k and v; gate and up; all the experts of a layer).
"""

from __future__ import annotations

import threading
from collections import namedtuple
from contextlib import contextmanager

import numpy as np
from numba import njit, types
from numba.extending import overload

from colibri.formats.encodings import ENCODINGS, FLOAT_DTYPES, block_size
from colibri.runtime import amx
from colibri.runtime.kernels.emitter import int_bits_to_float

F32 = np.float32
_njit = njit(cache=True, nogil=True)

# The int8 activation format each block type is multiplied with, as in ggml: the blocks of 256
# (K-quants, IQ4_XS, TQ1_0, TQ2_0, the IQ1/2/3 grid types) take Q8_K (one float32 scale per
# 256 values), so that a block's sub-block products stay integer to the end of the block; the
# 32-weight block types take Q8_0 (a float32 scale per 32).
# Both also hold the sum of each 16 levels, scaled (for the blocks' float offsets and biases)
# and as it is (for blocks whose product stays integer to the end of the block):
# q int8 [n, cols], d float32 [n, cols / block], sums float32 [n, cols / 16], bsums int16 [n, cols / 16].
ACT_BLOCKS = {"Q8_0": 32, "Q8_K": 256}  # activation values per int8 scale
DOT_TYPES = {e: "Q8_K" if block_size(e)[0] == ACT_BLOCKS["Q8_K"] else "Q8_0" for e in ENCODINGS if e not in FLOAT_DTYPES}
WIDEST_ACT_BLOCK = 256
Q8_0Activation = namedtuple("Q8_0Activation", "q d sums bsums")
Q8_KActivation = namedtuple("Q8_KActivation", "q d sums bsums")
# The same, multiplied with the row dots' float lanes (their fastest for one row): a token
# decoded alone (`decoding_alone`). Every other row takes `Q8_KActivation`, whose K-quant
# products are one integer a block (`blocks.INTEGER_TOTALS`), as the int8 tiles need
# (`int8_tiles`): a sequence's prompt, and every row of a batch step or sweep.
Q8_KLaneActivation = namedtuple("Q8_KLaneActivation", "q d sums bsums")
INT8_ACTIVATIONS = {"Q8_0": Q8_0Activation, "Q8_K": Q8_KActivation}

# Bound on the fast path's error relative to the output's max-abs, against float64 products of
# the same weights with gaussian activations (tests/test_kernels.py). Heavy-tailed activations
# can exceed it with Q8_K, whose one scale per 256 an outlier coarsens for more values, as in
# ggml. The measured errors are in bench/RESULTS.md.
FAST_PATH_TOLERANCE = 1.5e-2
FAST_ENCODINGS = tuple(DOT_TYPES)


@_njit
def _abs_max(values):
    """max |values| (contiguous float32): an integer max over the bits without the sign, which
    orders as the floats do, and which LLVM vectorizes (a float max it does not)."""
    bits = values.view(np.int32)
    top = np.int32(0)
    for i in range(bits.size):  # indices from 0: no negative-index checks, vectorized
        top = max(top, bits[i] & np.int32(0x7FFFFFFF))
    return int_bits_to_float(top)


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_blocks(values, q, d, sums, bsums, start, stop, block):
    """Quantize values[start:stop] (whole blocks of `block`) to int8: levels q, one scale d per
    block, and the sum of the levels of each 16, as it is (`bsums`) and times its block's
    scale (`sums`)."""
    for b in range(start // block, stop // block):
        x, levels = values[b * block:(b + 1) * block], q[b * block:(b + 1) * block]
        amax = _abs_max(x)
        d[b] = amax / F32(127.0)
        inverse = F32(127.0) / amax if amax > 0 else F32(0.0)
        for i in range(block):
            levels[i] = np.int8(np.rint(x[i] * inverse))
        for group in range(block // 16):
            total = np.int32(0)
            for i in range(16):
                total += levels[16 * group + i]
            bsums[b * block // 16 + group] = total
            sums[b * block // 16 + group] = d[b] * F32(total)


def empty_activation(n, cols, dot_type, lanes=False):
    """Uninitialized int8 activations of n rows of `cols` values in `dot_type` (multiplied with
    float lanes: `Q8_KLaneActivation`)."""
    kind = Q8_KLaneActivation if lanes and dot_type == "Q8_K" else INT8_ACTIVATIONS[dot_type]
    return kind(np.empty((n, cols), np.int8), np.empty((n, cols // ACT_BLOCKS[dot_type]), np.float32),
                np.empty((n, cols // 16), np.float32), np.empty((n, cols // 16), np.int16))


def activation_dot_type(act) -> str | None:
    """The dot type of a numba activation type ("Q8_0", "Q8_K"), None for float32 arrays."""
    if isinstance(act, types.BaseNamedTuple):
        for dot_type, activation in INT8_ACTIVATIONS.items():
            if act.instance_class is activation:
                return dot_type
        if act.instance_class is Q8_KLaneActivation:
            return "Q8_K"
    return None


def float_lanes(act) -> bool:
    """Whether a numba activation type is multiplied with float lanes (`Q8_KLaneActivation`)."""
    return isinstance(act, types.BaseNamedTuple) and act.instance_class is Q8_KLaneActivation


def fill_activation(act, values, start, stop):
    """Make values.flat[start:stop] usable as `act`: quantize it into an int8 tuple, or
    nothing when `act` is `values` itself (float path)."""


@overload(fill_activation)
def _fill_activation_overload(act, values, start, stop):
    if activation_dot_type(act) is not None:
        block = ACT_BLOCKS[activation_dot_type(act)]

        def quantize(act, values, start, stop):
            _quantize_blocks(values.reshape(-1), act.q.reshape(-1), act.d.reshape(-1), act.sums.reshape(-1),
                             act.bsums.reshape(-1), start, stop, block)
        return quantize
    return lambda act, values, start, stop: None


@_njit
def _quantize_all(act, values):
    fill_activation(act, values, 0, values.size)
    return act


def activation_row(act, i):
    """Activation i of a batch (a row of a float32 matrix, or of each int8 activation array), in
    compiled code; with an index array or a slice for i, those rows as a batch."""


@overload(activation_row)
def _activation_row_overload(act, i):
    if activation_dot_type(act) is not None:
        activation = act.instance_class
        return lambda act, i: activation(act.q[i], act.d[i], act.sums[i], act.bsums[i])
    return lambda act, i: act[i]


def dot_type_for(encoding: str, exact: bool) -> str | None:
    """The int8 activation format `encoding` weights are multiplied with, or None for float32
    activations (the exact path, and float weights)."""
    return None if exact else DOT_TYPES.get(encoding)


def float_rows(x: np.ndarray, cols: int) -> np.ndarray:
    """x as C-contiguous float32 [n, cols]; ValueError for any other shape."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"activations must have shape [n, {cols}], got {x.shape}")
    return x


_switches = threading.local()


@contextmanager
def _switched_on(name):
    """The thread's switch `name` on inside, as it was after."""
    before = getattr(_switches, name, False)
    setattr(_switches, name, True)
    try:
        yield
    finally:
        setattr(_switches, name, before)


def without_amx():
    """Products made inside (on this thread) take no AMX tiles whatever their number of rows:
    in a batch of sequences, which path a row takes must not depend on the rows beside it.
    (The int8 tiles need no such switch: a row gets the same bits on them and off them.)"""
    return _switched_on("amx_off")


def decoding_alone():
    """Int8 activations made inside (on this thread) are multiplied with float lanes
    (`Q8_KLaneActivation`), as the fused decode steps' own are: one token outside a batch."""
    return _switched_on("alone")


def make_activation(x: np.ndarray, dot_type: str | None, tiles: bool = True):
    """float32 [n, cols] as the kernels take it: x itself (None: the exact path); rounded to
    bfloat16 for AMX tiles when `tiles`, there are at least amx.MIN_TOKENS rows, the CPU has
    them and no `without_amx` is in force; else quantized to int8 `dot_type` activations
    (multiplied with float lanes inside `decoding_alone`)."""
    if dot_type is None:
        return x
    if tiles and x.shape[0] >= amx.MIN_TOKENS and not getattr(_switches, "amx_off", False) and amx.available():
        return amx.TileActivation(x)
    return _quantize_all(empty_activation(*x.shape, dot_type, lanes_in_force()), x)


def lanes_in_force() -> bool:
    """Whether int8 activations made now (on this thread) are multiplied with float lanes:
    inside `decoding_alone`."""
    return getattr(_switches, "alone", False)


def activation_rows(act, index):
    """Rows `index` of a batch of activations (an int: one activation, its vector or vectors)."""
    if isinstance(act, amx.TileActivation):
        return act.take(index)
    return act[index] if isinstance(act, np.ndarray) else type(act)(*(a[index] for a in act))
