"""The blocks whose levels index a table: IQ4_NL, IQ4_XS (ggml's non-linear 4-bit values) and
MXFP4 (the OCP microscaling 4-bit floats, with a power-of-two scale per 32 weights).

`quantize_<type>(rows f32[r, n], imatrix f32[n] or empty, out u8[r, row_bytes])` and
`dequantize_<type>(blocks u8[r, row_bytes], out f32[r, n])` as in `q32`. The comment above
each pair gives ggml's block layout (fp16 fields little-endian).
"""

import numpy as np

from colibri.convert.quantize_q4k.q32 import store_q4_levels
from colibri.convert.quantize_q4k.scalars import (
    bits_float, block_bytes, load_fp16, nearest_int, njit_c, store_fp16, sum_of_squares,
)
from colibri.formats.encodings import IQ4_VALUES, MXFP4_VALUES

F32 = np.float32
QK_K = 256
IQ4_NL_BYTES, IQ4_XS_BYTES, MXFP4_BYTES = block_bytes("IQ4_NL"), block_bytes("IQ4_XS"), block_bytes("MXFP4")
GROUP_MAX_EPS = F32(1e-15)
IQ4_TRIES = 7  # scale candidates either side of the first guess, as quantize_iq4_nl / _xs


@njit_c
def _best_index(values, x):
    """ggml best_index_int8: the index of the value of the sorted table nearest x."""
    n = values.size
    if x <= F32(values[0]):
        return 0
    if x >= F32(values[n - 1]):
        return n - 1
    low, high = 0, n - 1
    while high - low > 1:
        middle = (low + high) // 2
        if x < F32(values[middle]):
            high = middle
        else:
            low = middle
    return high - 1 if x - F32(values[high - 1]) < F32(values[high]) - x else high


@njit_c
def _weighted_fit(xb, weight, inverse_scale, L):
    """(sum w q x, sum w q^2) of xb's levels at `inverse_scale`; the levels go to L if given."""
    sumqx, sumq2 = F32(0.0), F32(0.0)
    for j in range(xb.size):
        level = _best_index(IQ4_VALUES, inverse_scale * xb[j])
        if L.size:
            L[j] = level
        q = F32(IQ4_VALUES[level])
        sumqx += weight[j] * q * xb[j]
        sumq2 += weight[j] * q * q
    return sumqx, sumq2


@njit_c
def _sub_block_scale(xb, weight, L):
    """ggml's scale search of one sub-block of 32 (quantize_row_iq4_nl_impl, ntry 7): the
    least-squares scale of the first guess, then of 15 more; 0 for a sub-block of zeros."""
    amax, top = F32(0.0), F32(0.0)
    for v in xb:
        if abs(v) > amax:
            amax, top = abs(v), v
    if amax < GROUP_MAX_EPS:
        return F32(0.0)
    d = -top / F32(IQ4_VALUES[0])
    sumqx, sumq2 = _weighted_fit(xb, weight, F32(1.0) / d, L)
    d = sumqx / sumq2 if sumq2 > 0 else F32(0.0)
    best = d * sumqx
    no_levels = L[:0]
    for attempt in range(-IQ4_TRIES, IQ4_TRIES + 1):
        sumqx, sumq2 = _weighted_fit(xb, weight, F32(attempt + IQ4_VALUES[0]) / top, no_levels)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit_c
def _sub_block_weights(xb, qw, sigma2, weight):
    """ggml's weights of a sub-block's errors: x² without an imatrix, qw·sqrt(σ² + x²) with one."""
    for j in range(xb.size):
        weight[j] = qw[j] * np.sqrt(sigma2 + xb[j] * xb[j]) if qw.size else xb[j] * xb[j]


@njit_c
def _store_iq4_levels(y, offset, L):
    """Sub-block i's 32 levels as Q4_0 packs them, in the 16 bytes at offset + 16 i."""
    for i in range(L.size // 32):
        store_q4_levels(y, offset + 16 * i, L[32 * i:32 * (i + 1)])


@njit_c
def _levels_at(xb, inverse_scale, L):
    """The index of the value nearest each weight times `inverse_scale`, into L."""
    for j in range(xb.size):
        L[j] = _best_index(IQ4_VALUES, inverse_scale * xb[j])


# block_iq4_nl: d (fp16), qs[16] (indices into IQ4_VALUES: weight j low nibble, j + 16 high)
@njit_c
def quantize_iq4_nl(rows, imatrix, out):
    weight = np.empty(32, np.float32)
    L = np.empty(32, np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // 32):
            x = rows[r, 32 * b:32 * (b + 1)]
            y = out[r, IQ4_NL_BYTES * b:IQ4_NL_BYTES * (b + 1)]
            sigma2 = sum_of_squares(x) * F32(2.0 / 32)
            _sub_block_weights(x, imatrix[32 * b:32 * (b + 1)] if imatrix.size else imatrix, sigma2, weight)
            d = _sub_block_scale(x, weight, L)
            store_fp16(y, 0, d)
            _levels_at(x, F32(1.0) / d if d != 0 else F32(0.0), L)
            _store_iq4_levels(y, 2, L)


@njit_c
def dequantize_iq4_nl(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // 32):
            y = blocks[r, IQ4_NL_BYTES * b:IQ4_NL_BYTES * (b + 1)]
            d = load_fp16(y, 0)
            for j in range(16):
                out[r, 32 * b + j] = d * F32(IQ4_VALUES[y[2 + j] & 0x0F])
                out[r, 32 * b + 16 + j] = d * F32(IQ4_VALUES[y[2 + j] >> 4])


# block_iq4_xs: d (fp16), scales_h (uint16: 2 high bits of sub-block i's scale at bit 2i),
# scales_l[4] (low 4 bits, sub-block 2k low nibble, 2k + 1 high), qs[128] (as IQ4_NL's, per 32)
@njit_c
def quantize_iq4_xs(rows, imatrix, out):
    weight = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    L = np.empty(QK_K, np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, IQ4_XS_BYTES * b:IQ4_XS_BYTES * (b + 1)]
            sigma2 = sum_of_squares(x) * F32(2.0 / QK_K)
            max_scale, amax_scale = F32(0.0), F32(0.0)
            for i in range(8):
                xb = x[32 * i:32 * (i + 1)]
                qw = imatrix[QK_K * b + 32 * i:QK_K * b + 32 * (i + 1)] if imatrix.size else imatrix
                _sub_block_weights(xb, qw, sigma2, weight)
                scales[i] = _sub_block_scale(xb, weight, L[32 * i:32 * (i + 1)])
                if abs(scales[i]) > amax_scale:
                    amax_scale, max_scale = abs(scales[i]), scales[i]
            d = -max_scale / F32(32)
            store_fp16(y, 0, d)
            inverse_d = F32(1.0) / d if d != 0 else F32(0.0)
            scales_h = 0
            for i in range(8):
                level = max(-32, min(31, nearest_int(inverse_d * scales[i])))
                dl = d * F32(level)
                _levels_at(x[32 * i:32 * (i + 1)], F32(1.0) / dl if dl != 0 else F32(0.0), L[32 * i:32 * (i + 1)])
                level += 32
                if i % 2 == 0:
                    y[4 + i // 2] = level & 0x0F
                else:
                    y[4 + i // 2] |= (level & 0x0F) << 4
                scales_h |= (level >> 4) << (2 * i)
            y[2], y[3] = scales_h & 0xFF, scales_h >> 8
            _store_iq4_levels(y, 8, L)


@njit_c
def _iq4_xs_scale(y, i):
    """Sub-block i's 6-bit scale, minus 32."""
    low = (np.int64(y[4 + i // 2]) >> (4 * (i % 2))) & 0x0F
    high = ((np.int64(y[2]) | (np.int64(y[3]) << 8)) >> (2 * i)) & 3
    return (low | (high << 4)) - 32


@njit_c
def dequantize_iq4_xs(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, IQ4_XS_BYTES * b:IQ4_XS_BYTES * (b + 1)]
            d = load_fp16(y, 0)
            for i in range(8):
                dl = d * F32(_iq4_xs_scale(y, i))
                base = QK_K * b + 32 * i
                for j in range(16):
                    out[r, base + j] = dl * F32(IQ4_VALUES[y[8 + 16 * i + j] & 0x0F])
                    out[r, base + 16 + j] = dl * F32(IQ4_VALUES[y[8 + 16 * i + j] >> 4])


@njit_c
def e8m0_half(e):
    """ggml_e8m0_to_fp32_half: 2**(e - 128) as a float32 (subnormal for e < 2)."""
    return bits_float(np.int64(0x00200000) << e if e < 2 else np.int64(e - 1) << 23)


@njit_c
def _best_mxfp4_index(x, d):
    best, best_error = 0, abs(F32(MXFP4_VALUES[0]) * d - x)
    for i in range(1, 16):
        error = abs(F32(MXFP4_VALUES[i]) * d - x)
        if error < best_error:
            best, best_error = i, error
    return best


# block_mxfp4: e (uint8, E8M0 exponent), qs[16] (indices into MXFP4_VALUES as IQ4_NL's)
@njit_c
def quantize_mxfp4(rows, imatrix, out):
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // 32):
            x = rows[r, 32 * b:32 * (b + 1)]
            y = out[r, MXFP4_BYTES * b:MXFP4_BYTES * (b + 1)]
            amax = F32(0.0)
            for v in x:
                if amax < abs(v):
                    amax = abs(v)
            e = (int(np.floor(np.log2(amax)) - F32(2) + F32(127)) & 0xFF) if amax > 0 else 0
            d = e8m0_half(e)
            y[0] = e
            for j in range(16):
                y[1 + j] = _best_mxfp4_index(x[j], d) | (_best_mxfp4_index(x[16 + j], d) << 4)


@njit_c
def dequantize_mxfp4(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // 32):
            y = blocks[r, MXFP4_BYTES * b:MXFP4_BYTES * (b + 1)]
            d = e8m0_half(np.int64(y[0]))
            for j in range(16):
                out[r, 32 * b + j] = F32(MXFP4_VALUES[y[1 + j] & 0x0F]) * d
                out[r, 32 * b + 16 + j] = F32(MXFP4_VALUES[y[1 + j] >> 4]) * d
