"""Weight matrices times activations: `Matrix`, `matmul` / `matvec` and the row lookup.

A weight matrix is a flat uint8 array of `rows * row_bytes` bytes in one of the encodings of
`formats/encodings.py` (GGML blocks, see `formats/spec.md` §2). A product takes one of three
paths, chosen per call by `exact`, the number of rows and the CPU:

- **fast** (`exact=False`, the default; Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q5_1): the activation
  is quantized to int8 as ggml does (`activations.DOT_TYPES`): in Q8_K blocks of 256 values
  for the K-quants, whose sub-block products then stay integer to the end of a block, and in
  Q8_0 blocks of 32 for the others. `matmul` unpacks each weight block once for GROUP rows of
  x, and passes each group over a tile of ROW_TILE rows (`rows.rows_times`); on CPUs with
  AVX-512 VNNI, products of many rows (prompts, batch steps, sweeps) take vpdpbusd tiles
  for Q4_K, Q5_K and Q6_K instead (`int8_tiles`), with the bits of their row dots (a token
  decoded alone keeps float lanes: `activations.Q8_KLaneActivation`). Error: see
  `FAST_PATH_TOLERANCE`.
- **tiles** (fast path, prompts of at least `amx.MIN_TOKENS` rows, CPUs with AMX): each
  block of 32 weight rows is dequantized to bfloat16 once and every token passes over it on
  the AMX tiles (`runtime/amx.py`); bfloat16 rounding errs less than the int8 path.
- **exact** (`exact=True`, and always for F32, F16 and BF16): each weight is dequantized to
  the float32 that `gguf.quants.dequantize` gives (bit for bit) and multiplied with the
  float32 activation, row by row as `row_dot` does for one activation.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from colibri.formats.encodings import row_bytes
from colibri.runtime import amx
from colibri.runtime.kernels.activations import (
    dot_type_for, empty_activation, float_rows, make_activation,
)
from colibri.runtime.kernels.blocks import BLOCK_TAGS
from colibri.runtime.kernels import int8_tiles
from colibri.runtime.kernels.emitter import target_isa
from colibri.runtime.kernels.rows import Product, dequantize_into, rows_per_head, rows_times
from colibri.runtime.kernels.threads import part_range, thread_count

_parallel = njit(cache=True, nogil=True, parallel=True)


@_parallel
def _matmul_kernel(tag, w, rows, cols, row_nbytes, act, out, nthreads):
    for t in prange(nthreads):
        first, stop = part_range(rows, nthreads, t, 1)
        rows_times(tag, w, first, stop, row_nbytes, cols, act, out)


@_parallel
def _tile_matmul_kernel(tag, w, rows, cols, row_nbytes, packed, out, nthreads):
    """out [n, rows] = the rows of `w` times the packed bfloat16 activations, with AMX tiles
    (`runtime/amx.py`): each thread dequantizes blocks of 32 rows to bfloat16 once and passes
    every token over them."""
    blocks = (rows + amx.BLOCK - 1) // amx.BLOCK
    config = amx.tile_config()
    for t in prange(nthreads):
        values = np.empty(cols, np.float32)
        weights = np.zeros((amx.BLOCK, cols + amx.ROW_PAD), np.uint16)
        sums = np.empty((amx.BLOCK, packed.shape[0] * 16), np.float32)
        amx.start(config)
        first, stop = part_range(blocks, nthreads, t, 1)
        for block in range(first, stop):
            top = block * amx.BLOCK
            count = min(amx.BLOCK, rows - top)
            for r in range(count):
                dequantize_into(tag, w, (top + r) * row_nbytes, cols, values)
                amx.round_row(values, weights[r])
            amx.block_product(weights, packed, sums)
            for i in range(out.shape[0]):
                for r in range(count):
                    out[i, top + r] = sums[r, i]
        amx.finish()


@_parallel
def _per_head_kernel(matrix, act, heads, stride, first, out, nthreads):
    for t in prange(nthreads):
        rows_per_head(t, nthreads, matrix, act, heads, stride, first, out)


@_parallel
def _dequantize_kernel(tag, w, first_row, cols, row_nbytes, out, nthreads):
    for t in prange(nthreads):
        first, stop = part_range(out.shape[0], nthreads, t, 1)
        for r in range(first, stop):
            dequantize_into(tag, w, (first_row + r) * row_nbytes, cols, out[r])


def _weights(w: np.ndarray, encoding: str, rows: int, cols: int) -> tuple[np.ndarray, int]:
    """`w` as a flat uint8 array of at least `rows` rows of `cols` weights, and the row size."""
    nbytes = row_bytes(encoding, cols)
    w = np.ascontiguousarray(w).reshape(-1)
    if w.dtype != np.uint8:
        raise ValueError(f"weights must be uint8 bytes, got {w.dtype}")
    if w.size < rows * nbytes:
        raise ValueError(f"{rows} rows of {cols} {encoding} weights need {rows * nbytes} bytes, got {w.size}")
    return w, nbytes


def matrix_times(tag, w: np.ndarray, rows: int, cols: int, row_nbytes: int, act, n: int) -> np.ndarray:
    """The [rows, cols] matrix at the start of `w` times an activation from `make_activation` of
    n rows -> float32 [n, rows]."""
    out = np.empty((n, rows), np.float32)
    if isinstance(act, amx.TileActivation):
        _tile_matmul_kernel(tag, w, rows, cols, row_nbytes, act.packed, out, thread_count())
    else:
        _matmul_kernel(tag, w, rows, cols, row_nbytes, act, out, thread_count())
    return out


class Matrix:
    """A [rows, cols] weight matrix in its stored encoding, checked once and then multiplied
    many times: the per-call work of a decode step is one activation and one kernel call."""

    def __init__(self, w: np.ndarray, encoding: str, rows: int, cols: int, exact: bool = False):
        self.data, self.row_nbytes = _weights(w, encoding, rows, cols)
        self.encoding, self.rows, self.cols = encoding, rows, cols
        self.tag = BLOCK_TAGS[encoding]
        self.dot_type = dot_type_for(encoding, exact)
        self.product = Product(self.tag, self.data, self.row_nbytes, rows, cols)  # what the kernels take of it
        self.observe = None  # called with every x this matrix multiplies, when set (importance matrices)

    def activation(self, x: np.ndarray, tiles: bool = True):
        """x float32 [n, cols] as this matrix's kernel takes it (on AMX tiles for a prompt,
        unless not `tiles`); share it between matrices of the same `dot_type` that multiply
        the same x."""
        return make_activation(float_rows(x, self.cols), self.dot_type, tiles)

    def empty_activation(self, n: int, lanes: bool = False):
        """An unfilled int8 activation of n rows for this matrix's kernels (fast path only),
        multiplied with float `lanes` (`activations.Q8_KLaneActivation`) or not."""
        return empty_activation(n, self.cols, self.dot_type, lanes)

    def times(self, act, n: int) -> np.ndarray:
        """The product with an activation from `activation` of n rows -> float32 [n, rows]."""
        return matrix_times(self.tag, self.data, self.rows, self.cols, self.row_nbytes, act, n)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x float32 [n, cols] -> float32 [n, rows]."""
        if self.observe is not None:
            self.observe(x)
        return self.times(self.activation(x), x.shape[0])

    def times_per_head(self, x: np.ndarray, heads: int, rows: int, stride: int, first: int = 0) -> np.ndarray:
        """x float32 [n * heads, cols], row g belonging to head g % heads, times that head's
        `rows` rows (first + head * stride onwards) -> float32 [n * heads, rows]: a slice of
        the matrix per head, as MLA's absorbed projections need."""
        if first + (heads - 1) * stride + rows > self.rows or x.shape[0] % heads:
            raise ValueError(f"{heads} heads of {rows} rows every {stride} from {first} do not fit {self.rows} rows")
        n = x.shape[0] // heads
        by_head = np.ascontiguousarray(float_rows(x, self.cols).reshape(n, heads, self.cols).transpose(1, 0, 2))
        out = np.empty((heads, n, rows), np.float32)
        act = self.activation(by_head.reshape(heads * n, self.cols), tiles=False)
        _per_head_kernel(self.product, act, heads, stride, first, out, thread_count())
        return out.transpose(1, 0, 2).reshape(n * heads, rows)

    def rows_f32(self, first: int, count: int) -> np.ndarray:
        return dequantize_rows(self.data, self.encoding, self.cols, first, count)


def products(x: np.ndarray, matrices) -> tuple[np.ndarray, ...]:
    """x float32 [n, cols] times each of `matrices`; the activation is quantized once for the
    matrices that share a path."""
    acts = {}
    for m in matrices:
        if m.observe is not None:
            m.observe(x)
        if m.dot_type not in acts:
            acts[m.dot_type] = m.activation(x)
    return tuple(m.times(acts[m.dot_type], x.shape[0]) for m in matrices)


def kernel_paths() -> dict:
    """Which instructions the kernels compiled in this process use, and whether prompts take
    the AMX tiles: for `colibri run --json` and the benchmarks."""
    tiles = ("AMX bfloat16" if amx.available() else
             "int8 vpdpbusd (Q4_K, Q5_K, Q6_K)" if int8_tiles.available() else "none (int8 path)")
    return {**target_isa().paths(), "prompt_tiles": tiles}


def matmul(w: np.ndarray, encoding: str, rows: int, cols: int, x: np.ndarray, exact: bool = False) -> np.ndarray:
    """x float32 [n, cols] times the [rows, cols] matrix `w` (transposed) -> float32 [n, rows]
    (prefill). `exact=True` multiplies in float32 instead of with int8 activations."""
    return Matrix(w, encoding, rows, cols, exact)(x)


def matvec(w: np.ndarray, encoding: str, rows: int, cols: int, x: np.ndarray, exact: bool = False) -> np.ndarray:
    """The [rows, cols] matrix `w` times x float32 [cols] -> float32 [rows] (decode).
    `exact=True` multiplies in float32 instead of with int8 activations."""
    x = np.asarray(x)
    if x.shape != (cols,):
        raise ValueError(f"x must have shape ({cols},), got {x.shape}")
    return matmul(w, encoding, rows, cols, x.reshape(1, cols), exact)[0]


def dequantize_rows(w: np.ndarray, encoding: str, cols: int, first: int, count: int) -> np.ndarray:
    """Rows first .. first+count-1 of the matrix `w` as float32 [count, cols] (embedding lookup)."""
    if first < 0 or count < 0:
        raise ValueError(f"bad row range: first={first}, count={count}")
    w, nbytes = _weights(w, encoding, first + count, cols)
    out = np.empty((count, cols), np.float32)
    _dequantize_kernel(BLOCK_TAGS[encoding], w, first, cols, nbytes, out, thread_count())
    return out
