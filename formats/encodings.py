"""Tensor encodings of the colibri layout: GGML's block types, byte for byte.

The sizes come from the `gguf` package (the reference for GGML's block layouts), so
this table and a GGUF file can never disagree. The byte layout of each block is
written out in `formats/spec.md`; quantizers live in `convert/`, kernels in `runtime/`.
"""

from __future__ import annotations

import math

from functools import cache

import gguf
import numpy as np

ENCODINGS = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
             "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0", "TQ2_0", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S",
             "IQ1_S", "IQ1_M")

# The values the 4-bit indices of IQ4_NL / IQ4_XS and of MXFP4 stand for (ggml-common.h's
# kvalues_iq4nl and kvalues_mxfp4, the latter twice the E2M1 values).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

# Float encodings that numpy can view directly (BF16 is read as uint16 and widened).
FLOAT_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}

# Byte offsets of the f16 scales (`d`, then `dmin` or `m`) within one block of each block type.
SCALE_OFFSETS = {"Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_0": (0,), "Q4_1": (0, 2), "Q2_K": (80, 82),
                 "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
                 "MXFP4": (), "TQ1_0": (52,), "TQ2_0": (64,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ2_XXS": (0,),
                 "IQ2_XS": (0,), "IQ2_S": (0,), "IQ1_S": (0,), "IQ1_M": ()}  # IQ1_M's d is spread over its scales
# Byte offsets of E8M0 exponent scales (0xFF is NaN) within one block.
E8M0_OFFSETS = {"MXFP4": (0,)}


class EncodingError(ValueError):
    """An encoding name or a row length that the layout cannot represent."""


def ggml_type(encoding: str) -> gguf.GGMLQuantizationType:
    """The GGML type with the same blocks as `encoding`."""
    if encoding not in ENCODINGS:
        raise EncodingError(f"unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
    return gguf.GGMLQuantizationType[encoding]


@cache  # on the runtime's hot path, where gguf's enum lookup is slow
def block_size(encoding: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of `encoding`."""
    return gguf.GGML_QUANT_SIZES[ggml_type(encoding)]


def fits(encoding: str, row_length: int) -> bool:
    """Whether rows of `row_length` weights are a whole number of blocks."""
    return row_length % block_size(encoding)[0] == 0


def row_bytes(encoding: str, row_length: int) -> int:
    """Bytes of one row of `row_length` weights."""
    weights, nbytes = block_size(encoding)
    if row_length % weights:
        raise EncodingError(f"{encoding} needs rows that are a multiple of {weights} weights, got {row_length}")
    return row_length // weights * nbytes


def tensor_bytes(encoding: str, shape) -> int:
    """Bytes of a row-major tensor of `shape` (last dimension innermost)."""
    shape = tuple(int(d) for d in shape)
    if not shape or min(shape) < 0:
        raise EncodingError(f"shape {list(shape)} has no rows of weights")
    return math.prod(shape[:-1]) * row_bytes(encoding, shape[-1])
