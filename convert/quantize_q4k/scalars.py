"""What every quantizer shares, each as C computes it: float bits, rounding, fp16 conversions,
the int8 wrap, block sizes, and `njit_c`, the numba options that keep float arithmetic C's.
"""

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32

# error_model="numpy": a float division by zero gives inf/nan as in C instead of raising.
njit_c = njit(cache=True, nogil=True, error_model="numpy")


def block_bytes(qtype: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]


@njit_c
def sum_of_squares(x):
    """The float32 sum of x[i]^2, left to right (the start of every imatrix weighting)."""
    total = F32(0.0)
    for v in x:
        total += v * v
    return total


@intrinsic
def _float_bits(typingctx, value):
    """The IEEE bits of a float32, as a non-negative int64 (C: memcpy to uint32_t)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@intrinsic
def bits_float(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of an int64."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen


@njit_c
def nearest_int(fval):
    """ggml nearest_int: round half to even via the 1.5 * 2**23 trick."""
    return (_float_bits(fval + F32(12582912.0)) & 0x007FFFFF) - 0x00400000


@njit_c
def round_half_away(value):
    """C roundf (half away from zero) for |value| < 2**31, as an int."""
    whole = int(value)
    fraction = value - F32(whole)
    if fraction >= F32(0.5):
        whole += 1
    elif fraction <= F32(-0.5):
        whole -= 1
    return whole


@njit_c
def _fp32_to_fp16(f):
    """ggml_compute_fp32_to_fp16 (round to nearest even), as int bits."""
    base = (abs(f) * bits_float(0x77800000)) * bits_float(0x08800000)
    w = _float_bits(f)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = max(shl1_w & 0xFF000000, 0x71000000)
    base = bits_float((bias >> 1) + 0x07800000) + base
    bits = _float_bits(base)
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    return ((sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign)) & 0xFFFF


@njit_c
def _fp16_to_fp32(h):
    """Exact float32 value of IEEE half bits."""
    sign = (h & 0x8000) << 16
    exponent = (h >> 10) & 0x1F
    mantissa = h & 0x03FF
    if exponent == 0:
        magnitude = F32(mantissa) * F32(2.0**-24)
        return -magnitude if sign else magnitude
    if exponent == 31:
        return bits_float(sign | 0x7F800000 | (mantissa << 13))
    return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13))


@njit_c
def as_int8(value):
    """The int8 that C gets by storing value (two's complement wrap)."""
    return ((value + 128) & 0xFF) - 128


@njit_c
def store_fp16(y, offset, value):
    h = _fp32_to_fp16(value)
    y[offset] = h & 0xFF
    y[offset + 1] = h >> 8


@njit_c
def load_fp16(y, offset):
    return _fp16_to_fp32(np.int64(y[offset]) | (np.int64(y[offset + 1]) << 8))
