"""GGML block quantizers, byte-identical to ggml's reference C code (ggml-quants.c).

Each numba function ports its namesake in ggml-quants.c: `quantize_<type>(x, nrows, n,
imatrix)`, which runs `quantize_row_<type>_ref` without an imatrix and the `_impl` variant
with one. Bit-exactness rests on doing every float operation as C does: in float32 (operands
are cast explicitly, as numba would promote int * float32 to float64), sums left to right,
no fastmath (a fused multiply-add rounds differently). Where a loop is restructured for
speed, the float32 operations and their order per sum are unchanged.
"""

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32
QK_K = gguf.QK_K
QK = 32  # weights per Q8_0 / Q5_0 / Q5_1 block
GROUP_MAX_EPS = F32(1e-15)
FLT_MAX = np.finfo(np.float32).max


def _block_bytes(qtype: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]


Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = _block_bytes("Q4_K"), _block_bytes("Q5_K"), _block_bytes("Q6_K")
Q8_0_BYTES, Q5_0_BYTES, Q5_1_BYTES = _block_bytes("Q8_0"), _block_bytes("Q5_0"), _block_bytes("Q5_1")

# (rmin, rdelta, nstep) of ggml's make_qkx2_quants / make_qkx3_quants scale searches. As
# tuples they reach numba as plain (not literal) values: one compiled search per nmax.
Q4_K_SEARCH = (F32(-1.0), F32(0.1), 20)
Q5_K_SEARCH = (F32(-0.5), F32(0.1), 15)
IMATRIX_SEARCH = (F32(-0.9), F32(0.05), 36)

# error_model="numpy": a float division by zero gives inf/nan as in C instead of raising.
_njit = njit(cache=True, nogil=True, error_model="numpy")


# ---------------------------------------------------------------- bit-level helpers


@intrinsic
def _float_bits(typingctx, value):
    """The IEEE bits of a float32, as a non-negative int64 (C: memcpy to uint32_t)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@intrinsic
def _bits_float(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of an int64."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen


@_njit
def _nearest_int(fval):
    """ggml nearest_int: round half to even via the 1.5 * 2**23 trick."""
    return (_float_bits(fval + F32(12582912.0)) & 0x007FFFFF) - 0x00400000


@_njit
def _round_half_away(value):
    """C roundf (half away from zero) for |value| < 2**31, as an int."""
    whole = int(value)
    fraction = value - F32(whole)
    if fraction >= F32(0.5):
        whole += 1
    elif fraction <= F32(-0.5):
        whole -= 1
    return whole


@_njit
def _fp32_to_fp16(f):
    """ggml_compute_fp32_to_fp16 (round to nearest even), as int bits."""
    base = (abs(f) * _bits_float(0x77800000)) * _bits_float(0x08800000)
    w = _float_bits(f)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = max(shl1_w & 0xFF000000, 0x71000000)
    base = _bits_float((bias >> 1) + 0x07800000) + base
    bits = _float_bits(base)
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    return ((sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign)) & 0xFFFF


@_njit
def _fp16_to_fp32(h):
    """Exact float32 value of IEEE half bits."""
    sign = (h & 0x8000) << 16
    exponent = (h >> 10) & 0x1F
    mantissa = h & 0x03FF
    if exponent == 0:
        magnitude = F32(mantissa) * F32(2.0**-24)
        return -magnitude if sign else magnitude
    if exponent == 31:
        return _bits_float(sign | 0x7F800000 | (mantissa << 13))
    return _bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13))


@_njit
def _as_int8(value):
    """The int8 that C gets by storing value (two's complement wrap)."""
    return ((value + 128) & 0xFF) - 128


@_njit
def _store_fp16(y, offset, value):
    h = _fp32_to_fp16(value)
    y[offset] = h & 0xFF
    y[offset + 1] = h >> 8


@_njit
def _load_fp16(y, offset):
    return _fp16_to_fp32(np.int64(y[offset]) | (np.int64(y[offset + 1]) << 8))


# ---------------------------------------------------------------- ggml scale searches


@_njit
def _make_qx_quants(nmax, x, weights, L):
    """make_qx_quants (rmse_type 1, weights given): levels L in [0, 2*nmax) for
    x ~ scale*(L - nmax). Returns the scale.

    The 18 trial scales do not depend on each other, so their sums are accumulated side by
    side (one float32 chain per trial, in C's order, which the compiler can vectorize across
    trials); C's sequential choice among them follows."""
    n = x.size
    max_value = F32(0.0)
    amax = F32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            max_value = x[i]
    if amax < GROUP_MAX_EPS:
        L[:n] = 0
        return F32(0.0)
    iscale = F32(-nmax) / max_value
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        level = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = level + nmax
        fl = F32(level)
        sumlx += weights[i] * x[i] * fl
        suml2 += weights[i] * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx

    trials = 18  # is = -9..9 without 0
    iscales = np.empty(trials, np.float32)
    for t in range(trials):
        step = t - 9 if t < 9 else t - 8
        iscales[t] = -(F32(nmax) + F32(0.1) * F32(step)) / max_value
    trial_sumlx = np.zeros(trials, np.float32)
    trial_suml2 = np.zeros(trials, np.float32)
    trial_levels = np.empty((n, trials), np.uint8)
    for i in range(n):
        wx = weights[i] * x[i]
        for t in range(trials):
            level = max(-nmax, min(nmax - 1, _nearest_int(iscales[t] * x[i])))
            trial_levels[i, t] = level + nmax
            fl = F32(level)
            trial_sumlx[t] += wx * fl
            trial_suml2[t] += weights[i] * fl * fl
    for t in range(trials):
        sumlx = trial_sumlx[t]
        suml2 = trial_suml2[t]
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L[:n] = trial_levels[:, t]
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@_njit
def _make_qkx_quants(nmax, x, weights, L, search):
    """make_qkx2_quants / make_qkx3_quants (use_mad=false, weights given): levels L in
    [0, nmax] for x ~ scale*L - the_min. Returns (scale, the_min).

    Each trial depends on the previous one (through min), so trials run in order; within a
    trial the element-wise products get their own vectorizable loops and only the float32
    sums, in C's order, stay scalar."""
    rmin, rdelta, nstep = search
    n = x.size
    min_value = x[0]
    max_value = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < min_value:
            min_value = x[i]
        if x[i] > max_value:
            max_value = x[i]
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if min_value > 0:
        min_value = F32(0.0)
    if max_value <= min_value:
        L[:n] = 0
        return F32(0.0), -min_value
    iscale = F32(nmax) / (max_value - min_value)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest_int(iscale * (x[i] - min_value))))
        diff = scale * F32(L[i]) + min_value - x[i]
        best_error += weights[i] * (diff * diff)

    Laux = np.empty(n, np.uint8)
    products = np.empty((4, n), np.float32)
    wl, wl2, wlx, werr = products[0], products[1], products[2], products[3]
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + F32(nmax)) / (max_value - min_value)
        for i in range(n):
            Laux[i] = max(0, min(nmax, _nearest_int(iscale * (x[i] - min_value))))
        for i in range(n):
            wl[i] = weights[i] * F32(Laux[i])
        for i in range(n):
            wl2[i] = wl[i] * F32(Laux[i])
        for i in range(n):
            wlx[i] = wl[i] * x[i]
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            sum_l += wl[i]
            sum_l2 += wl2[i]
            sum_xl += wlx[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                werr[i] = weights[i] * (diff * diff)
            error = F32(0.0)
            for i in range(n):
                error += werr[i]
            if error < best_error:
                L[:n] = Laux
                best_error = error
                scale = this_scale
                min_value = this_min
    return scale, -min_value


@_njit
def _make_qp_quants(nmax, x, L, quant_weights):
    """make_qp_quants: levels L in [0, nmax] for the non-negative sub-block scales (or mins)
    x, weighted by quant_weights. Returns the super-block scale."""
    n = x.size
    max_value = F32(0.0)
    for i in range(n):
        max_value = max_value if max_value > x[i] else x[i]
    if max_value < GROUP_MAX_EPS:
        L[:n] = 0
        return F32(0.0)
    iscale = F32(nmax) / max_value
    for i in range(n):
        L[i] = _nearest_int(iscale * x[i]) & 0xFF
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += quant_weights[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_step = (F32(0.1) * F32(step) + F32(nmax)) / max_value
        scale_step = F32(1.0) / iscale_step
        mse = F32(0.0)
        for i in range(n):
            level = min(nmax, _nearest_int(iscale_step * x[i]))
            diff = x[i] - scale_step * F32(level)
            mse += quant_weights[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_step
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        level = min(nmax, _nearest_int(iscale * x[i]))
        L[i] = level & 0xFF
        fl = F32(level)
        sumlx += quant_weights[i] * x[i] * fl
        suml2 += quant_weights[i] * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = quant_weights[i]
            old = F32(L[i])
            slx = sumlx - w * x[i] * old
            sl2 = suml2 - w * old * old
            if slx > 0 and sl2 > 0:
                new_level = min(nmax, _nearest_int(x[i] * sl2 / slx))
                if new_level != L[i]:
                    slx += w * x[i] * F32(new_level)
                    sl2 += w * F32(new_level) * F32(new_level)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_level & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


# ---------------------------------------------------------------- shared Q4_K / Q5_K part


@_njit
def _get_scale_min_k4(j, q):
    """The 6-bit (scale, min) of sub-block j from the 12 packed bytes q."""
    if j < 4:
        return np.int64(q[j] & 63), np.int64(q[j + 4] & 63)
    return (np.int64((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
            np.int64((q[j + 4] >> 4) | ((q[j] >> 6) << 4)))


@_njit
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
            sum_x2 = F32(0.0)
            for v in xs:
                sum_x2 += v * v
            av_x = np.sqrt(sum_x2 / F32(32))
            for i in range(32):
                weights[i] = av_x + abs(xs[i])
            if nmax == 15:
                scales[j], mins[j] = _make_qkx_quants(15, xs, weights, L[32 * j:], Q4_K_SEARCH)
            else:
                scales[j], mins[j] = _make_qkx_quants(31, xs, weights, L[32 * j:], Q5_K_SEARCH)
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
            Ls[j] = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)
            Lm[j] = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
        d_block = max_scale / F32(63.0)
        m_block = max_min / F32(63.0)
    else:  # quantize_row_qX_K_impl with quant_weights
        sw = np.empty(8, np.float32)
        sum_x2 = F32(0.0)
        for v in x:
            sum_x2 += v * v
        sigma2 = F32(2.0) * sum_x2 / F32(QK_K)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            for i in range(32):
                weights[i] = qw[32 * j + i] * np.sqrt(sigma2 + xs[i] * xs[i])
            sumw = F32(0.0)
            for w in weights:
                sumw += w
            sw[j] = sumw
            scales[j], mins[j] = _make_qkx_quants(nmax, xs, weights, L[32 * j:], IMATRIX_SEARCH)
        d_block = _make_qp_quants(63, scales, Ls, sw)
        m_block = _make_qp_quants(63, mins, Lm, sw)
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
    _store_fp16(y, 0, d_block)
    _store_fp16(y, 2, m_block)
    d_all = _load_fp16(y, 0)
    m_all = _load_fp16(y, 2)
    for j in range(8):
        sc, m = _get_scale_min_k4(j, packed)
        d = d_all * F32(sc)
        if d == 0:
            continue
        dm = m_all * F32(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, _nearest_int((x[32 * j + i] + dm) / d)))


@_njit
def _dequantize_scale_min_k4(y, j):
    """(d * scale, dmin * min) of sub-block j of a Q4_K / Q5_K block."""
    sc, m = _get_scale_min_k4(j, y[4:16])
    return _load_fp16(y, 0) * F32(sc), _load_fp16(y, 2) * F32(m)


# ---------------------------------------------------------------- block kernels
# _quantize_<type>(rows f32[r, n], imatrix f32[n] or empty, out u8[r, row_bytes]) and
# _dequantize_<type>(blocks u8[r, row_bytes], out f32[r, n]) loop over rows and blocks.
# The comment above each pair gives ggml's block layout (fp16 fields little-endian).


# block_q4_K: d, dmin (fp16), scales[12] (packed 6-bit scale/min), qs[128] (nibbles)
@_njit
def _quantize_q4_k(rows, imatrix, out):
    L = np.empty(QK_K, np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            x = rows[r, QK_K * b:QK_K * (b + 1)]
            y = out[r, Q4_K_BYTES * b:Q4_K_BYTES * (b + 1)]
            _quantize_scale_min_k4(x, imatrix[QK_K * b:QK_K * (b + 1)], 15, y, L)
            for j in range(0, QK_K, 64):
                for i in range(32):
                    y[16 + j // 2 + i] = L[j + i] | (L[j + i + 32] << 4)


@_njit
def _dequantize_q4_k(blocks, out):
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
@_njit
def _quantize_q5_k(rows, imatrix, out):
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


@_njit
def _dequantize_q5_k(blocks, out):
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
@_njit
def _quantize_q6_k(rows, imatrix, out):
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
                scales[j] = _make_qx_quants(32, xs, weights, L[16 * j:])
                if abs(scales[j]) > max_abs_scale:
                    max_abs_scale = abs(scales[j])
                    max_scale = scales[j]
            if max_abs_scale < GROUP_MAX_EPS:
                y[:] = 0
                continue
            iscale = F32(-128.0) / max_scale
            _store_fp16(y, 208, F32(1.0) / iscale)
            d_all = _load_fp16(y, 208)
            for j in range(16):
                scale = min(127, _nearest_int(iscale * scales[j]))
                y[192 + j] = scale & 0xFF
                d = d_all * F32(_as_int8(scale))
                if d == 0:
                    continue
                for i in range(16):
                    L[16 * j + i] = max(-32, min(31, _nearest_int(x[16 * j + i] / d))) + 32
            for j in range(0, QK_K, 128):
                for i in range(32):
                    q1, q2, q3, q4 = L[j + i], L[j + i + 32], L[j + i + 64], L[j + i + 96]
                    y[j // 2 + i] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                    y[j // 2 + i + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
                    y[128 + j // 4 + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@_njit
def _dequantize_q6_k(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK_K):
            y = blocks[r, Q6_K_BYTES * b:Q6_K_BYTES * (b + 1)]
            x = out[r, QK_K * b:QK_K * (b + 1)]
            d = _load_fp16(y, 208)
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
                        scale = _as_int8(np.int64(y[192 + j // 16 + i // 16 + 2 * k]))
                        x[j + 32 * k + i] = d * F32(scale) * F32(quants[k] - 32)


# block_q8_0: d (fp16), qs[32] (int8)
@_njit
def _quantize_q8_0(rows, imatrix, out):
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK):
            x = rows[r, QK * b:QK * (b + 1)]
            y = out[r, Q8_0_BYTES * b:Q8_0_BYTES * (b + 1)]
            amax = F32(0.0)
            for v in x:
                amax = amax if amax > abs(v) else abs(v)
            d = amax / F32(127)
            inv_d = F32(1.0) / d if d != 0 else F32(0.0)
            _store_fp16(y, 0, d)
            for i in range(QK):
                y[2 + i] = _round_half_away(x[i] * inv_d) & 0xFF


@_njit
def _dequantize_q8_0(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK):
            y = blocks[r, Q8_0_BYTES * b:Q8_0_BYTES * (b + 1)]
            d = _load_fp16(y, 0)
            for i in range(QK):
                out[r, QK * b + i] = F32(_as_int8(np.int64(y[2 + i]))) * d


# block_q5_0: d (fp16), qh[4] (fifth bits), qs[16] (nibbles); block_q5_1 adds m (fp16) after d
@_njit
def _store_q5_levels(y, offset, L):
    """Pack 32 five-bit levels: qh (4 bytes, bit j = high bit of level j) then 16 nibble bytes."""
    qh = 0
    for j in range(16):
        y[offset + 4 + j] = (L[j] & 0x0F) | ((L[j + 16] & 0x0F) << 4)
        qh |= ((L[j] & 0x10) >> 4) << j
        qh |= ((L[j + 16] & 0x10) >> 4) << (j + 16)
    for k in range(4):
        y[offset + k] = (qh >> (8 * k)) & 0xFF


@_njit
def _load_q5_level(y, offset, j):
    qh = np.int64(y[offset + j // 8])
    q = np.int64(y[offset + 4 + j % 16])
    return ((q >> 4) if j >= 16 else (q & 0x0F)) | (((qh >> (j % 8)) & 1) << 4)


@_njit
def _row_sigma2(x):
    sum_x2 = F32(0.0)
    for v in x:
        sum_x2 += v * v
    return sum_x2 / F32(x.size)


@_njit
def _quantize_q5_0(rows, imatrix, out):
    L = np.empty(QK, np.uint8)
    weights = np.empty(QK, np.float32)
    for r in range(rows.shape[0]):
        sigma2 = _row_sigma2(rows[r]) if imatrix.size else F32(0.0)
        for b in range(rows.shape[1] // QK):
            x = rows[r, QK * b:QK * (b + 1)]
            y = out[r, Q5_0_BYTES * b:Q5_0_BYTES * (b + 1)]
            if imatrix.size:  # quantize_row_q5_0_impl
                for i in range(QK):
                    weights[i] = imatrix[QK * b + i] * np.sqrt(sigma2 + x[i] * x[i])
                d = _make_qx_quants(16, x, weights, L)
            else:  # quantize_row_q5_0_ref
                amax = F32(0.0)
                max_value = F32(0.0)
                for v in x:
                    if amax < abs(v):
                        amax = abs(v)
                        max_value = v
                d = max_value / F32(-16)
                inv_d = F32(1.0) / d if d != 0 else F32(0.0)
                for i in range(QK):
                    L[i] = min(31, int(x[i] * inv_d + F32(16.5)) & 0xFF)
            _store_fp16(y, 0, d)
            _store_q5_levels(y, 2, L)


@_njit
def _dequantize_q5_0(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK):
            y = blocks[r, Q5_0_BYTES * b:Q5_0_BYTES * (b + 1)]
            d = _load_fp16(y, 0)
            for j in range(QK):
                out[r, QK * b + j] = F32(_load_q5_level(y, 2, j) - 16) * d


@_njit
def _quantize_q5_1(rows, imatrix, out):
    L = np.empty(QK, np.uint8)
    weights = np.empty(QK, np.float32)
    for r in range(rows.shape[0]):
        sigma2 = _row_sigma2(rows[r]) if imatrix.size else F32(0.0)
        for b in range(rows.shape[1] // QK):
            x = rows[r, QK * b:QK * (b + 1)]
            y = out[r, Q5_1_BYTES * b:Q5_1_BYTES * (b + 1)]
            if imatrix.size:  # quantize_row_q5_1_impl
                for i in range(QK):
                    weights[i] = imatrix[QK * b + i] * np.sqrt(sigma2 + x[i] * x[i])
                d, the_min = _make_qkx_quants(31, x, weights, L, IMATRIX_SEARCH)
                min_value = -the_min
            else:  # quantize_row_q5_1_ref
                min_value = FLT_MAX
                max_value = -FLT_MAX
                for v in x:
                    if v < min_value:
                        min_value = v
                    if v > max_value:
                        max_value = v
                d = (max_value - min_value) / F32(31)
                inv_d = F32(1.0) / d if d != 0 else F32(0.0)
                for i in range(QK):
                    L[i] = int((x[i] - min_value) * inv_d + F32(0.5)) & 0xFF
            _store_fp16(y, 0, d)
            _store_fp16(y, 2, min_value)
            _store_q5_levels(y, 4, L)


@_njit
def _dequantize_q5_1(blocks, out):
    for r in range(blocks.shape[0]):
        for b in range(out.shape[1] // QK):
            y = blocks[r, Q5_1_BYTES * b:Q5_1_BYTES * (b + 1)]
            d = _load_fp16(y, 0)
            m = _load_fp16(y, 2)
            for j in range(QK):
                out[r, QK * b + j] = F32(_load_q5_level(y, 4, j)) * d + m


# ---------------------------------------------------------------- public API

_BLOCK_CODECS = {
    "Q4_K": (_quantize_q4_k, _dequantize_q4_k),
    "Q5_K": (_quantize_q5_k, _dequantize_q5_k),
    "Q6_K": (_quantize_q6_k, _dequantize_q6_k),
    "Q8_0": (_quantize_q8_0, _dequantize_q8_0),
    "Q5_0": (_quantize_q5_0, _dequantize_q5_0),
    "Q5_1": (_quantize_q5_1, _dequantize_q5_1),
}
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _row_layout(qtype: str, n: int) -> int:
    """Bytes per row of n weights; ValueError for an unknown type or a ragged row."""
    if qtype not in _BLOCK_CODECS and qtype not in _FLOAT_TYPES:
        raise ValueError(f"unsupported quantization type {qtype!r}; "
                         f"expected one of {sorted(_BLOCK_CODECS) + list(_FLOAT_TYPES)}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    if n % block_size:
        raise ValueError(f"{qtype} quantizes rows in blocks of {block_size} weights, "
                         f"but the row length {n} is not a multiple of {block_size}")
    return n // block_size * type_size


def _fp32_to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: quiet NaNs, otherwise round to nearest even."""
    u = x.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
    quiet_nan = (u >> 16) | 64
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded).astype(np.uint16)


def quantize(x: np.ndarray, qtype: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Encode float rows [..., n] as GGML qtype bytes [..., row_bytes], exactly as ggml's
    quantize_<qtype>(x, nrows, n, imatrix) does. imatrix: importance weights [n] or None
    (ignored by F32, F16, BF16 and Q8_0, as in ggml)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[-1]
    row_bytes = _row_layout(qtype, n)
    if imatrix is None:
        imatrix = np.empty(0, np.float32)
    else:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n,):
            raise ValueError(f"imatrix must have shape ({n},) to match the rows, got {imatrix.shape}")
    if qtype == "F32":
        return x.view(np.uint8).reshape(*x.shape[:-1], row_bytes).copy()
    if qtype == "F16":
        return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], row_bytes)
    if qtype == "BF16":
        return _fp32_to_bf16(x).view(np.uint8).reshape(*x.shape[:-1], row_bytes)
    out = np.empty((*x.shape[:-1], row_bytes), np.uint8)
    quantize_rows, _ = _BLOCK_CODECS[qtype]
    quantize_rows(x.reshape(-1, n), imatrix, out.reshape(-1, row_bytes))
    return out


def dequantize(data: np.ndarray, qtype: str, n: int) -> np.ndarray:
    """Decode GGML qtype bytes [..., row_bytes] into float32 rows [..., n]."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    row_bytes = _row_layout(qtype, n)
    if data.shape[-1] != row_bytes:
        raise ValueError(f"a row of {n} {qtype} weights takes {row_bytes} bytes, got {data.shape[-1]}")
    lead = data.shape[:-1]
    if qtype == "F32":
        return data.view(np.float32).reshape(*lead, n).copy()
    if qtype == "F16":
        return data.view(np.float16).astype(np.float32).reshape(*lead, n)
    if qtype == "BF16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(*lead, n)
    out = np.empty((*lead, n), np.float32)
    _, dequantize_rows = _BLOCK_CODECS[qtype]
    dequantize_rows(data.reshape(-1, row_bytes), out.reshape(-1, n))
    return out
