"""The blocks of 32 weights: Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1.

`quantize_<type>(rows f32[r, n], imatrix f32[n] or empty, out u8[r, row_bytes])` and
`dequantize_<type>(blocks u8[r, row_bytes], out f32[r, n])` loop over rows and blocks. The
comment above each pair gives ggml's block layout (fp16 fields little-endian).
"""

import numpy as np

from colibri.convert.quantize_q4k.scalars import (
    as_int8, block_bytes, load_fp16, njit_c, round_half_away, store_fp16, sum_of_squares,
)
from colibri.convert.quantize_q4k.searches import IMATRIX_SEARCH, make_qkx_quants, make_qx_quants, signed_max

F32 = np.float32
QK = 32  # weights per block of each of these types
FLT_MAX = np.finfo(np.float32).max
Q8_0_BYTES, Q5_0_BYTES, Q5_1_BYTES = block_bytes("Q8_0"), block_bytes("Q5_0"), block_bytes("Q5_1")
Q4_0_BYTES, Q4_1_BYTES = block_bytes("Q4_0"), block_bytes("Q4_1")


# block_q8_0: d (fp16), qs[32] (int8)
@njit_c
def quantize_q8_0(rows, imatrix, out):
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK):
            x = rows[r, QK * b:QK * (b + 1)]
            y = out[r, Q8_0_BYTES * b:Q8_0_BYTES * (b + 1)]
            amax = F32(0.0)
            for v in x:
                amax = amax if amax > abs(v) else abs(v)
            d = amax / F32(127)
            inv_d = F32(1.0) / d if d != 0 else F32(0.0)
            store_fp16(y, 0, d)
            for i in range(QK):
                y[2 + i] = round_half_away(x[i] * inv_d) & 0xFF


@njit_c
def dequantize_q8_0(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK):
            y = blocks[r, Q8_0_BYTES * b:Q8_0_BYTES * (b + 1)]
            d = load_fp16(y, 0)
            for i in range(QK):
                out[r, QK * b + i] = F32(as_int8(np.int64(y[2 + i]))) * d


# block_q5_0: d (fp16), qh[4] (fifth bits), qs[16] (nibbles); block_q5_1 adds m (fp16) after d
@njit_c
def _store_q5_levels(y, offset, L):
    """Pack 32 five-bit levels: qh (4 bytes, bit j = high bit of level j) then 16 nibble bytes."""
    qh = 0
    for j in range(16):
        y[offset + 4 + j] = (L[j] & 0x0F) | ((L[j + 16] & 0x0F) << 4)
        qh |= ((L[j] & 0x10) >> 4) << j
        qh |= ((L[j + 16] & 0x10) >> 4) << (j + 16)
    for k in range(4):
        y[offset + k] = (qh >> (8 * k)) & 0xFF


@njit_c
def _load_q5_level(y, offset, j):
    qh = np.int64(y[offset + j // 8])
    q = np.int64(y[offset + 4 + j % 16])
    return ((q >> 4) if j >= 16 else (q & 0x0F)) | (((qh >> (j % 8)) & 1) << 4)


@njit_c
def _row_sigma2(x):
    return sum_of_squares(x) / F32(x.size)


@njit_c
def quantize_q5_0(rows, imatrix, out):
    _quantize_symmetric(rows, imatrix, out, 16, Q5_0_BYTES)


@njit_c
def dequantize_q5_0(blocks, out):
    _dequantize(blocks, out, 16, Q5_0_BYTES, False)


@njit_c
def quantize_q5_1(rows, imatrix, out):
    _quantize_with_min(rows, imatrix, out, 31, Q5_1_BYTES)


@njit_c
def dequantize_q5_1(blocks, out):
    _dequantize(blocks, out, 31, Q5_1_BYTES, True)


# block_q4_0: d (fp16), qs[16] (nibbles: low = weights 0-15, high = weights 16-31); block_q4_1 adds m after d
@njit_c
def store_q4_levels(y, offset, L):
    """32 four-bit levels as 16 bytes at `offset`: level j in the low nibble of byte j, j + 16 in the high."""
    for j in range(16):
        y[offset + j] = (L[j] & 0x0F) | ((L[j + 16] & 0x0F) << 4)


@njit_c
def _load_q4_level(y, offset, j):
    q = np.int64(y[offset + j % 16])
    return (q >> 4) if j >= 16 else (q & 0x0F)


@njit_c
def quantize_q4_0(rows, imatrix, out):
    _quantize_symmetric(rows, imatrix, out, 8, Q4_0_BYTES)


@njit_c
def dequantize_q4_0(blocks, out):
    _dequantize(blocks, out, 8, Q4_0_BYTES, False)


@njit_c
def quantize_q4_1(rows, imatrix, out):
    _quantize_with_min(rows, imatrix, out, 15, Q4_1_BYTES)


@njit_c
def dequantize_q4_1(blocks, out):
    _dequantize(blocks, out, 15, Q4_1_BYTES, True)


# Q5_0 / Q4_0 (weight = d * (level - nmax)) and Q5_1 / Q4_1 (weight = d * level + m) share
# their quantizers, parametrized by the level range: 5 bits when nmax is 16 or 31, else 4.
@njit_c
def _store_levels(y, offset, L, five_bits):
    if five_bits:
        _store_q5_levels(y, offset, L)
    else:
        store_q4_levels(y, offset, L)


@njit_c
def _quantize_symmetric(rows, imatrix, out, nmax, nbytes):
    """quantize_q5_0 / quantize_q4_0: quantize_row_*_ref, or _impl with an imatrix."""
    L = np.empty(QK, np.uint8)
    weights = np.empty(QK, np.float32)
    for r in range(rows.shape[0]):
        sigma2 = _row_sigma2(rows[r]) if imatrix.size else F32(0.0)
        for b in range(rows.shape[1] // QK):
            x = rows[r, QK * b:QK * (b + 1)]
            y = out[r, nbytes * b:nbytes * (b + 1)]
            if imatrix.size:
                for i in range(QK):
                    weights[i] = imatrix[QK * b + i] * np.sqrt(sigma2 + x[i] * x[i])
                d = make_qx_quants(nmax, x, weights, L)
            else:
                d = signed_max(x)[1] / F32(-nmax)
                inv_d = F32(1.0) / d if d != 0 else F32(0.0)
                for i in range(QK):
                    L[i] = min(2 * nmax - 1, int(x[i] * inv_d + (F32(nmax) + F32(0.5))) & 0xFF)
            store_fp16(y, 0, d)
            _store_levels(y, 2, L, nmax == 16)


@njit_c
def _quantize_with_min(rows, imatrix, out, nmax, nbytes):
    """quantize_q5_1 / quantize_q4_1: quantize_row_*_ref, or _impl with an imatrix. (ggml
    clamps Q4_1's levels to 15 and leaves Q5_1's unclamped; so does this.)"""
    L = np.empty(QK, np.uint8)
    weights = np.empty(QK, np.float32)
    for r in range(rows.shape[0]):
        sigma2 = _row_sigma2(rows[r]) if imatrix.size else F32(0.0)
        for b in range(rows.shape[1] // QK):
            x = rows[r, QK * b:QK * (b + 1)]
            y = out[r, nbytes * b:nbytes * (b + 1)]
            if imatrix.size:
                for i in range(QK):
                    weights[i] = imatrix[QK * b + i] * np.sqrt(sigma2 + x[i] * x[i])
                d, the_min = make_qkx_quants(nmax, x, weights, L, IMATRIX_SEARCH)
                min_value = -the_min
            else:
                min_value = FLT_MAX
                max_value = -FLT_MAX
                for v in x:
                    if v < min_value:
                        min_value = v
                    if v > max_value:
                        max_value = v
                d = (max_value - min_value) / F32(nmax)
                inv_d = F32(1.0) / d if d != 0 else F32(0.0)
                for i in range(QK):
                    level = int((x[i] - min_value) * inv_d + F32(0.5)) & 0xFF
                    L[i] = level if nmax == 31 else min(15, level)
            store_fp16(y, 0, d)
            store_fp16(y, 2, min_value)
            _store_levels(y, 4, L, nmax == 31)


@njit_c
def _dequantize(blocks, out, nmax, nbytes, has_min):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK):
            y = blocks[r, nbytes * b:nbytes * (b + 1)]
            d = load_fp16(y, 0)
            if has_min:
                m = load_fp16(y, 2)
                for j in range(QK):
                    level = _load_q5_level(y, 4, j) if nmax == 31 else _load_q4_level(y, 4, j)
                    out[r, QK * b + j] = F32(level) * d + m
            else:
                for j in range(QK):
                    level = _load_q5_level(y, 2, j) if nmax == 16 else _load_q4_level(y, 2, j)
                    out[r, QK * b + j] = F32(level - nmax) * d
