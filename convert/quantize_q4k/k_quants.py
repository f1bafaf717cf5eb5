"""The K-quant blocks of 256 weights: Q4_K and Q5_K (with their shared 6-bit scales and mins), Q6_K,
Q2_K and Q3_K.

`quantize_<type>(rows f32[r, n], imatrix f32[n] or empty, out u8[r, row_bytes])` and
`dequantize_<type>(blocks u8[r, row_bytes], out f32[r, n])` loop over rows and blocks. The
comment above each pair gives ggml's block layout (fp16 fields little-endian).
"""

import gguf
import numpy as np

from colibri.convert.quantize_q4k.scalars import (
    as_int8, block_bytes, load_fp16, nearest_int, njit_c, store_fp16, sum_of_squares,
)
from colibri.convert.quantize_q4k.searches import (
    GROUP_MAX_EPS, IMATRIX_SEARCH, Q2_K_SEARCH, Q4_K_SEARCH, Q5_K_SEARCH, make_q3_quants, make_qkx_quants,
    make_qp_quants, make_qx_quants,
)

F32 = np.float32
QK_K = gguf.QK_K
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = block_bytes("Q4_K"), block_bytes("Q5_K"), block_bytes("Q6_K")
Q2_K_BYTES, Q3_K_BYTES = block_bytes("Q2_K"), block_bytes("Q3_K")


@njit_c
def _get_scale_min_k4(j, q):
    """The 6-bit (scale, min) of sub-block j from the 12 packed bytes q."""
    if j < 4:
        return np.int64(q[j] & 63), np.int64(q[j + 4] & 63)
    return (np.int64((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
            np.int64((q[j + 4] >> 4) | ((q[j] >> 6) << 4)))


@njit_c
def _quantize_scale_min_k4(x, qw, nmax, y, L):
    """The common half of quantize_row_q{4,5}_K_ref / _impl: writes d, dmin and the 12 packed
    6-bit scale/min bytes to y[0:16] and the levels (0..nmax) of the 256 weights to L."""
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    weights = np.empty(32, np.float32)
    Ls = np.empty(8, np.uint8)
    Lm = np.empty(8, np.uint8)
    if qw.size == 0:  # quantize_row_qX_K_ref
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            av_x = np.sqrt(sum_of_squares(xs) / F32(32))
            for i in range(32):
                weights[i] = av_x + abs(xs[i])
            if nmax == 15:
                scales[j], mins[j] = make_qkx_quants(15, xs, weights, L[32 * j:], Q4_K_SEARCH)
            else:
                scales[j], mins[j] = make_qkx_quants(31, xs, weights, L[32 * j:], Q5_K_SEARCH)
        max_scale = F32(0.0)
        max_min = F32(0.0)
        for j in range(8):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = F32(63.0) / max_scale if max_scale > 0 else F32(0.0)
        inv_min = F32(63.0) / max_min if max_min > 0 else F32(0.0)
        for j in range(8):
            Ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
            Lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        d_block = max_scale / F32(63.0)
        m_block = max_min / F32(63.0)
    else:  # quantize_row_qX_K_impl with quant_weights
        sw = np.empty(8, np.float32)
        sigma2 = F32(2.0) * sum_of_squares(x) / F32(QK_K)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            for i in range(32):
                weights[i] = qw[32 * j + i] * np.sqrt(sigma2 + xs[i] * xs[i])
            sumw = F32(0.0)
            for w in weights:
                sumw += w
            sw[j] = sumw
            scales[j], mins[j] = make_qkx_quants(nmax, xs, weights, L[32 * j:], IMATRIX_SEARCH)
        d_block = make_qp_quants(63, scales, Ls, sw)
        m_block = make_qp_quants(63, mins, Lm, sw)
        if nmax == 31:  # only quantize_row_q5_K_impl clamps (a no-op unless a scale is negative)
            for j in range(8):
                Ls[j] = min(63, Ls[j])
                Lm[j] = min(63, Lm[j])
    packed = y[4:16]
    for j in range(8):
        if j < 4:
            packed[j] = Ls[j]
            packed[j + 4] = Lm[j]
        else:
            packed[j + 4] = (Ls[j] & 0xF) | ((Lm[j] & 0xF) << 4)
            packed[j - 4] |= ((Ls[j] >> 4) << 6) & 0xFF
            packed[j] |= ((Lm[j] >> 4) << 6) & 0xFF
    store_fp16(y, 0, d_block)
    store_fp16(y, 2, m_block)
    d_all = load_fp16(y, 0)
    m_all = load_fp16(y, 2)
    for j in range(8):
        sc, m = _get_scale_min_k4(j, packed)
        d = d_all * F32(sc)
        if d == 0:
            continue
        dm = m_all * F32(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int((x[32 * j + i] + dm) / d)))


@njit_c
def _dequantize_scale_min_k4(y, j):
    """(d * scale, dmin * min) of sub-block j of a Q4_K / Q5_K block."""
    sc, m = _get_scale_min_k4(j, y[4:16])
    return load_fp16(y, 0) * F32(sc), load_fp16(y, 2) * F32(m)


# block_q4_K: d, dmin (fp16), scales[12] (packed 6-bit scale/min), qs[128] (nibbles)
@njit_c
def quantize_q4_k(rows, imatrix, out):
    L = np.empty(QK_K, np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, Q4_K_BYTES * b:Q4_K_BYTES * (b + 1)]
            _quantize_scale_min_k4(x, imatrix[QK_K * b:QK_K * (b + 1)], 15, y, L)
            for j in range(0, QK_K, 64):
                for i in range(32):
                    y[16 + j // 2 + i] = L[j + i] | (L[j + i + 32] << 4)


@njit_c
def dequantize_q4_k(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, Q4_K_BYTES * b:Q4_K_BYTES * (b + 1)]
            x = out[r, QK_K * b:QK_K * (b + 1)]
            for j in range(0, QK_K, 64):
                d1, m1 = _dequantize_scale_min_k4(y, j // 32)
                d2, m2 = _dequantize_scale_min_k4(y, j // 32 + 1)
                for i in range(32):
                    q = y[16 + j // 2 + i]
                    x[j + i] = d1 * F32(q & 0xF) - m1
                    x[j + 32 + i] = d2 * F32(q >> 4) - m2


# block_q5_K: d, dmin (fp16), scales[12], qh[32] (fifth bits), qs[128] (low nibbles)
@njit_c
def quantize_q5_k(rows, imatrix, out):
    L = np.empty(QK_K, np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, Q5_K_BYTES * b:Q5_K_BYTES * (b + 1)]
            _quantize_scale_min_k4(x, imatrix[QK_K * b:QK_K * (b + 1)], 31, y, L)
            qh = y[16:48]
            qh[:] = 0
            for j in range(0, QK_K, 64):
                low_bit = 1 << (j // 32)
                for i in range(32):
                    l1 = L[j + i]
                    l2 = L[j + i + 32]
                    if l1 > 15:
                        l1 -= 16
                        qh[i] |= low_bit
                    if l2 > 15:
                        l2 -= 16
                        qh[i] |= low_bit << 1
                    y[48 + j // 2 + i] = l1 | (l2 << 4)


@njit_c
def dequantize_q5_k(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, Q5_K_BYTES * b:Q5_K_BYTES * (b + 1)]
            x = out[r, QK_K * b:QK_K * (b + 1)]
            for j in range(0, QK_K, 64):
                d1, m1 = _dequantize_scale_min_k4(y, j // 32)
                d2, m2 = _dequantize_scale_min_k4(y, j // 32 + 1)
                low_bit = 1 << (j // 32)
                for i in range(32):
                    q = y[48 + j // 2 + i]
                    h = y[16 + i]
                    x[j + i] = d1 * F32((q & 0xF) + (16 if h & low_bit else 0)) - m1
                    x[j + 32 + i] = d2 * F32((q >> 4) + (16 if h & (low_bit << 1) else 0)) - m2


# block_q6_K: ql[128] (low nibbles), qh[64] (2-bit high parts), scales[16] (int8), d (fp16)
@njit_c
def quantize_q6_k(rows, imatrix, out):
    L = np.empty(QK_K, np.uint8)
    scales = np.empty(16, np.float32)
    weights = np.empty(16, np.float32)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, Q6_K_BYTES * b:Q6_K_BYTES * (b + 1)]
            max_scale = F32(0.0)
            max_abs_scale = F32(0.0)
            for j in range(16):
                xs = x[16 * j:16 * j + 16]
                if imatrix.size:
                    weights[:] = imatrix[QK_K * b + 16 * j:QK_K * b + 16 * j + 16]
                else:
                    for i in range(16):
                        weights[i] = xs[i] * xs[i]
                scales[j] = make_qx_quants(32, xs, weights, L[16 * j:])
                if abs(scales[j]) > max_abs_scale:
                    max_abs_scale = abs(scales[j])
                    max_scale = scales[j]
            if max_abs_scale < GROUP_MAX_EPS:
                y[:] = 0
                continue
            iscale = F32(-128.0) / max_scale
            store_fp16(y, 208, F32(1.0) / iscale)
            d_all = load_fp16(y, 208)
            for j in range(16):
                scale = min(127, nearest_int(iscale * scales[j]))
                y[192 + j] = scale & 0xFF
                d = d_all * F32(as_int8(scale))
                if d == 0:
                    continue
                for i in range(16):
                    L[16 * j + i] = max(-32, min(31, nearest_int(x[16 * j + i] / d))) + 32
            for j in range(0, QK_K, 128):
                for i in range(32):
                    q1, q2, q3, q4 = L[j + i], L[j + i + 32], L[j + i + 64], L[j + i + 96]
                    y[j // 2 + i] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                    y[j // 2 + i + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
                    y[128 + j // 4 + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@njit_c
def dequantize_q6_k(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, Q6_K_BYTES * b:Q6_K_BYTES * (b + 1)]
            x = out[r, QK_K * b:QK_K * (b + 1)]
            d = load_fp16(y, 208)
            for j in range(0, QK_K, 128):
                for i in range(32):
                    ql1 = y[j // 2 + i]
                    ql2 = y[j // 2 + i + 32]
                    qh = y[128 + j // 4 + i]
                    quants = ((ql1 & 0xF) | (((qh >> 0) & 3) << 4),
                              (ql2 & 0xF) | (((qh >> 2) & 3) << 4),
                              (ql1 >> 4) | (((qh >> 4) & 3) << 4),
                              (ql2 >> 4) | (((qh >> 6) & 3) << 4))
                    for k in range(4):
                        scale = as_int8(np.int64(y[192 + j // 16 + i // 16 + 2 * k]))
                        x[j + 32 * k + i] = d * F32(scale) * F32(quants[k] - 32)


@njit_c
def _pack_two_bit_levels(y, offset, L):
    """The low 2 bits of the 256 levels L into the 64 bytes at y[offset:]: byte 32h + i holds
    weights 128h + i + 32s in bits 2s..2s+1 (Q2_K's and Q3_K's qs)."""
    for h in range(2):
        for i in range(32):
            base = 128 * h + i
            y[offset + 32 * h + i] = (L[base] & 3) | ((L[base + 32] & 3) << 2) | ((L[base + 64] & 3) << 4) | (
                (L[base + 96] & 3) << 6)


# block_q2_K: scales[16] (4-bit scale | 4-bit min << 4, one per 16 weights), qs[64] (2-bit
# levels: byte 32h + l holds weights 128h + l + 32s in bits 2s..2s+1), d, dmin (fp16)
@njit_c
def quantize_q2_k(rows, imatrix, out):
    L = np.empty(QK_K, np.uint8)
    weights = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, Q2_K_BYTES * b:Q2_K_BYTES * (b + 1)]
            if imatrix.size:
                _quantize_q2_k_weighted(x, imatrix[QK_K * b:QK_K * (b + 1)], y, L)
                continue
            # quantize_row_q2_K_ref
            max_scale = F32(0.0)
            max_min = F32(0.0)
            for j in range(16):
                xs = x[16 * j:16 * j + 16]
                for i in range(16):
                    weights[i] = abs(xs[i])
                scales[j], mins[j] = make_qkx_quants(3, xs, weights, L[16 * j:], Q2_K_SEARCH)
                if scales[j] > max_scale:
                    max_scale = scales[j]
                if mins[j] > max_min:
                    max_min = mins[j]
            if max_scale > 0:
                inv_scale = F32(15.0) / max_scale
                for j in range(16):
                    y[j] = nearest_int(inv_scale * scales[j])
                store_fp16(y, 80, max_scale / F32(15.0))
            else:
                y[:16] = 0
                store_fp16(y, 80, F32(0.0))
            if max_min > 0:
                inv_min = F32(15.0) / max_min
                for j in range(16):
                    y[j] |= nearest_int(inv_min * mins[j]) << 4
                store_fp16(y, 82, max_min / F32(15.0))
            else:
                store_fp16(y, 82, F32(0.0))
            _store_q2_k_levels(x, y, L)


@njit_c
def _store_q2_k_levels(x, y, L):
    """The levels of the 256 weights requantized with the block's stored scales and mins (a
    group whose scale is 0 keeps the levels of its search), packed into qs."""
    d_all, dmin_all = load_fp16(y, 80), load_fp16(y, 82)
    for j in range(16):
        d = d_all * F32(y[j] & 0xF)
        if d == 0:
            continue
        dm = dmin_all * F32(y[j] >> 4)
        for i in range(16):
            L[16 * j + i] = max(0, min(3, nearest_int((x[16 * j + i] + dm) / d)))
    _pack_two_bit_levels(y, 16, L)


@njit_c
def _quantize_q2_k_weighted(x, qw, y, L):
    """quantize_row_q2_K_impl for one block: weighted searches, then the scales and mins of
    the 16 groups quantized to 4 bits by make_qp_quants."""
    weights = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    group_weights = np.zeros(16, np.float32)
    Ls = np.empty(16, np.uint8)
    Lm = np.empty(16, np.uint8)
    sigma2 = sum_of_squares(x) / F32(QK_K)
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        for i in range(16):
            weights[i] = qw[16 * j + i] * np.sqrt(sigma2 + xs[i] * xs[i])
            group_weights[j] += weights[i]
        scales[j], mins[j] = make_qkx_quants(3, xs, weights, L[16 * j:], IMATRIX_SEARCH)
    store_fp16(y, 80, make_qp_quants(15, scales, Ls, group_weights))
    store_fp16(y, 82, make_qp_quants(15, mins, Lm, group_weights))
    for j in range(16):
        y[j] = Ls[j] | (Lm[j] << 4)
    _store_q2_k_levels(x, y, L)


@njit_c
def dequantize_q2_k(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, Q2_K_BYTES * b:Q2_K_BYTES * (b + 1)]
            d, dmin = load_fp16(y, 80), load_fp16(y, 82)
            for h in range(2):
                for s in range(4):
                    for i in range(32):
                        group = 8 * h + 2 * s + i // 16
                        level = (np.int64(y[16 + 32 * h + i]) >> (2 * s)) & 3
                        dl, ml = d * F32(y[group] & 0xF), dmin * F32(y[group] >> 4)
                        out[r, QK_K * b + 128 * h + 32 * s + i] = dl * F32(level) - ml


# block_q3_K: hmask[32] (bit s of byte l: 4 added to the level of weight 32s + l), qs[64] (2-bit
# parts, as Q2_K's), scales[12] (16 packed 6-bit scales, stored + 32), d (fp16)
@njit_c
def _pack_q3_k_scale(y, j, level):
    """Store scale level j (0..63) in the 12 scale bytes at y[96:108]."""
    if j < 8:
        y[96 + j] = level & 0xF
    else:
        y[96 + j - 8] |= (level & 0xF) << 4
    y[96 + 8 + j % 4] |= (level >> 4) << (2 * (j // 4))


@njit_c
def _q3_k_scale(y, j):
    """Scale j (-32..31) of the 12 scale bytes at y[96:108], as _pack_q3_k_scale stored it."""
    low = (y[96 + j] & 0xF) if j < 8 else (y[96 + j - 8] >> 4)
    return (np.int64(low) | (((np.int64(y[96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32


@njit_c
def _store_q3_k_levels(x, y, L):
    """Requantize the 256 weights with the stored scales (a group whose scale is 0 keeps the
    levels of its search), then split the levels into hmask and the 2-bit qs."""
    d_all = load_fp16(y, 108)
    for j in range(16):
        d = d_all * F32(_q3_k_scale(y, j))
        if d == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int(x[16 * j + i] / d))) + 4
    y[:32] = 0
    for j in range(QK_K):
        if L[j] > 3:
            y[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    _pack_two_bit_levels(y, 32, L)


@njit_c
def quantize_q3_k(rows, imatrix, out):
    L = np.empty(QK_K, np.uint8)
    scales = np.empty(16, np.float32)
    weights = np.empty(16, np.float32)
    group_weights = np.empty(16, np.float32)
    Ls = np.empty(16, np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, Q3_K_BYTES * b:Q3_K_BYTES * (b + 1)]
            y[96:108] = 0
            if imatrix.size:  # quantize_row_q3_K_impl
                sigma2 = F32(2.0) * sum_of_squares(x) / F32(QK_K)
                for j in range(16):
                    xs = x[16 * j:16 * j + 16]
                    total = F32(0.0)
                    for i in range(16):
                        weights[i] = imatrix[QK_K * b + 16 * j + i] * np.sqrt(sigma2 + xs[i] * xs[i])
                        total += weights[i]
                    group_weights[j] = total
                    scales[j] = make_qx_quants(4, xs, weights, L[16 * j:])
                d_block = make_qx_quants(32, scales, group_weights, Ls)
                for j in range(16):
                    _pack_q3_k_scale(y, j, np.int64(Ls[j]))
                store_fp16(y, 108, d_block)
            else:  # quantize_row_q3_K_ref
                max_scale = F32(0.0)
                amax = F32(0.0)
                for j in range(16):
                    scales[j] = make_q3_quants(4, x[16 * j:16 * j + 16], L[16 * j:])
                    if abs(scales[j]) > amax:
                        amax = abs(scales[j])
                        max_scale = scales[j]
                if max_scale != 0:
                    iscale = F32(-32.0) / max_scale
                    for j in range(16):
                        _pack_q3_k_scale(y, j, max(-32, min(31, nearest_int(iscale * scales[j]))) + 32)
                    store_fp16(y, 108, F32(1.0) / iscale)
                else:
                    store_fp16(y, 108, F32(0.0))
            _store_q3_k_levels(x, y, L)


@njit_c
def dequantize_q3_k(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, Q3_K_BYTES * b:Q3_K_BYTES * (b + 1)]
            d = load_fp16(y, 108)
            for h in range(2):
                for s in range(4):
                    for i in range(32):
                        sc = _q3_k_scale(y, 8 * h + 2 * s + i // 16)
                        level = (np.int64(y[32 + 32 * h + i]) >> (2 * s)) & 3
                        high = (np.int64(y[i]) >> (4 * h + s)) & 1
                        out[r, QK_K * b + 128 * h + 32 * s + i] = (d * F32(sc)) * F32(level - (0 if high else 4))
