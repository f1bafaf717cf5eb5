"""The ternary blocks: TQ1_0 and TQ2_0, weights of -1, 0 or 1 times one fp16 scale per 256.

`quantize_<type>(rows f32[r, n], imatrix (ignored, as in ggml), out u8[r, row_bytes])` and
`dequantize_<type>(blocks u8[r, row_bytes], out f32[r, n])` as in `q32`.
"""

import numpy as np

from colibri.convert.quantize_q4k.scalars import block_bytes, load_fp16, njit_c, round_half_away, store_fp16

F32 = np.float32
QK_K = 256
TQ1_0_BYTES, TQ2_0_BYTES = block_bytes("TQ1_0"), block_bytes("TQ2_0")
# TQ1_0's runs of bytes, each holding trits of `count` bytes apart: (first byte, bytes, trits per byte)
TQ1_0_RUNS = ((0, 32, 5), (32, 16, 5), (48, 4, 4))
POWERS_OF_3 = np.array([1, 3, 9, 27, 81, 243], np.int64)


@njit_c
def _block_scale(x):
    amax = F32(0.0)
    for v in x:
        amax = max(amax, abs(v))
    return amax, F32(1.0) / amax if amax != 0 else F32(0.0)


@njit_c
def _trit(value, inverse_scale):
    """-1, 0, 1 -> 0, 1, 2, with C's lroundf."""
    return round_half_away(value * inverse_scale) + 1


# block_tq1_0: qs[48] (5 trits a byte: bytes 0-31 hold weights m + 32 n, bytes 32-47 weights
# 160 + m + 16 n), qh[4] (4 trits a byte: weights 240 + m + 4 n), d (fp16). A byte holding
# trits t_0 .. t_k-1 (first most significant) is ceil(256 * value / 243), the top trit first
# after multiplying by 3**n (mod 256): ((byte * 3**n mod 256) * 3) >> 8.
@njit_c
def quantize_tq1_0(rows, imatrix, out):
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, TQ1_0_BYTES * b:TQ1_0_BYTES * (b + 1)]
            d, inverse_d = _block_scale(x)
            store_fp16(y, 52, d)
            weight = 0
            for first, count, trits in TQ1_0_RUNS:
                for m in range(count):
                    q = 0
                    for n in range(trits):
                        q = q * 3 + _trit(x[weight + m + n * count], inverse_d)
                    if trits == 4:  # the first value goes to the most significant trit
                        q *= 3
                    y[first + m] = ((q & 0xFF) * 256 + 242) // 243
                weight += trits * count


@njit_c
def dequantize_tq1_0(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, TQ1_0_BYTES * b:TQ1_0_BYTES * (b + 1)]
            d = load_fp16(y, 52)
            weight = QK_K * b
            for first, count, trits in TQ1_0_RUNS:
                for n in range(trits):
                    for m in range(count):
                        q = (np.int64(y[first + m]) * POWERS_OF_3[n]) & 0xFF
                        out[r, weight + m + n * count] = F32(((q * 3) >> 8) - 1) * d
                weight += trits * count


# block_tq2_0: qs[64] (2 bits a weight: weight 128 h + 32 n + m at bits 2n of byte 32 h + m,
# 0, 1, 2 for -1, 0, 1), d (fp16)
@njit_c
def quantize_tq2_0(rows, imatrix, out):
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, TQ2_0_BYTES * b:TQ2_0_BYTES * (b + 1)]
            d, inverse_d = _block_scale(x)
            store_fp16(y, 64, d)
            for h in range(2):
                for m in range(32):
                    q = 0
                    for n in range(4):
                        q += (_trit(x[128 * h + 32 * n + m], inverse_d) & 3) << (2 * n)
                    y[32 * h + m] = q


@njit_c
def dequantize_tq2_0(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, TQ2_0_BYTES * b:TQ2_0_BYTES * (b + 1)]
            d = load_fp16(y, 64)
            for h in range(2):
                for n in range(4):
                    for m in range(32):
                        level = (np.int64(y[32 * h + m]) >> (2 * n)) & 3
                        out[r, QK_K * b + 128 * h + 32 * n + m] = F32(level - 1) * d
