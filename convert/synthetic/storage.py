"""How float32 values are stored: bf16 rounded to nearest-even on the high 16 bits, FP8
as DeepSeek-V3's block-quantised e4m3 (FP8_BLOCK² blocks, ``scale_inv = amax / 448``)."""

from __future__ import annotations

import numpy as np

from colibri.formats.checkpoint import E4M3_TO_F32, FP8_BLOCK


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest-even), returned as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).copy()
    bf16_round_inplace(u)
    return u.astype(np.uint16)


def bf16_round_inplace(u: np.ndarray) -> None:
    """``u`` (uint32 view of float32) becomes its bf16 bits in the low 16 bits."""
    t = u >> 16
    t &= 1
    t += 0x7FFF
    u += t
    u >>= 16


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def fp8_e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """Decode float8 e4m3fn byte codes (uint8) to float32 (0x7F/0xFF are NaN)."""
    return E4M3_TO_F32[np.asarray(codes, dtype=np.uint8)]


def encode_e4m3(q: np.ndarray) -> np.ndarray:
    """float32 in [-448, 448] -> e4m3fn codes, round to nearest even (= torch's cast)."""
    a = np.abs(q).astype(np.float32)
    u = a.view(np.uint32).copy()
    t = (u >> 20) & 1  # round the float32 mantissa to 3 bits, ties to even
    t += 0x7FFFF
    u += t
    u >>= 20
    normal = u.astype(np.int32)
    normal -= (127 - 7) << 3  # rebias the exponent: code = (exp - 120) << 3 | mantissa
    np.clip(normal, 0, 0x7E, out=normal)
    sub = np.rint(a * np.float32(512.0)).astype(np.int32)  # subnormals: multiples of 2**-9
    codes = np.where(a < np.float32(2.0**-6), sub, normal).astype(np.uint8)
    codes |= np.signbit(q).astype(np.uint8) << 7
    return codes


def fp8_quantize_2d(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise a [rows, cols] float32 matrix: (e4m3 codes, F32 scale_inv blocks)."""
    rows, cols = x.shape
    R, C = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    xp = np.zeros((R * FP8_BLOCK, C * FP8_BLOCK), dtype=np.float32)
    xp[:rows, :cols] = x
    blocks = xp.reshape(R, FP8_BLOCK, C, FP8_BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = (amax / np.float32(448.0)).astype(np.float32)
    scale[scale == 0] = 1.0
    q = (blocks / scale[:, None, :, None]).reshape(R * FP8_BLOCK, C * FP8_BLOCK)[:rows, :cols]
    return encode_e4m3(q), scale


def fp8_quantize_tensor(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A 2-D weight, or a fused [E, rows, cols] one matrix by matrix."""
    if x.ndim == 2:
        return fp8_quantize_2d(x)
    pairs = [fp8_quantize_2d(m) for m in x]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
