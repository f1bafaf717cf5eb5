"""GGML block quantizers, byte-identical to ggml's reference C code (ggml-quants.c): every block
type colibri-convert makes, not only Q4_K (the package keeps the name of the design's first
module, `convert/quantize_q4k.py`).

Each numba function ports its namesake in ggml-quants.c: `quantize_<type>(x, nrows, n,
imatrix)`, which runs `quantize_row_<type>_ref` without an imatrix and the `_impl` variant
with one. Bit-exactness rests on doing every float operation as C does: in float32 (operands
are cast explicitly, as numba would promote int * float32 to float64), sums left to right,
no fastmath (a fused multiply-add rounds differently). Where a loop is restructured for
speed, the float32 operations and their order per sum are unchanged.

`quantize` and `dequantize` (here) take every type; the block types live in `k_quants`
(Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), `q32` (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1), `nonlinear` (IQ4_NL,
IQ4_XS, MXFP4), `ternary` (TQ1_0, TQ2_0) and `grids` (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S,
IQ1_S, IQ1_M: quantized here, decoded by gguf-py's decoder, which is bit-identical to ggml's),
built on ggml's scale searches (`searches`) and C's scalar conversions (`scalars`). IQ2_XXS,
IQ2_XS and IQ1_S need an importance matrix, as in ggml.
"""

from pathlib import Path

import gguf
import numpy as np

from colibri import kernel_cache
from colibri.formats import encodings
from colibri.formats.iq_grids import GRID_ENCODINGS

_HERE = Path(__file__).resolve().parent
# the scalar intrinsics and tables the quantizers are compiled with (kernel_cache says why)
kernel_cache.drop_if_stale("quantizers", [*_HERE.glob("*.py"), encodings.__file__], [_HERE / "__pycache__"])

from colibri.convert.quantize_q4k.grids import (  # noqa: E402
    quantize_iq1_m, quantize_iq1_s, quantize_iq2_s, quantize_iq2_xs, quantize_iq2_xxs, quantize_iq3_s, quantize_iq3_xxs,
)
from colibri.convert.quantize_q4k.k_quants import (  # noqa: E402
    dequantize_q2_k, dequantize_q3_k, dequantize_q4_k, dequantize_q5_k, dequantize_q6_k, quantize_q2_k, quantize_q3_k,
    quantize_q4_k, quantize_q5_k, quantize_q6_k,
)
from colibri.convert.quantize_q4k.nonlinear import (  # noqa: E402
    dequantize_iq4_nl, dequantize_iq4_xs, dequantize_mxfp4, quantize_iq4_nl, quantize_iq4_xs, quantize_mxfp4,
)
from colibri.convert.quantize_q4k.q32 import (  # noqa: E402
    dequantize_q4_0, dequantize_q4_1, dequantize_q5_0, dequantize_q5_1, dequantize_q8_0, quantize_q4_0, quantize_q4_1,
    quantize_q5_0, quantize_q5_1, quantize_q8_0,
)
from colibri.convert.quantize_q4k.ternary import (  # noqa: E402
    dequantize_tq1_0, dequantize_tq2_0, quantize_tq1_0, quantize_tq2_0,
)

_BLOCK_CODECS = {
    "Q4_K": (quantize_q4_k, dequantize_q4_k),
    "Q5_K": (quantize_q5_k, dequantize_q5_k),
    "Q6_K": (quantize_q6_k, dequantize_q6_k),
    "Q8_0": (quantize_q8_0, dequantize_q8_0),
    "Q5_0": (quantize_q5_0, dequantize_q5_0),
    "Q5_1": (quantize_q5_1, dequantize_q5_1),
    "Q4_0": (quantize_q4_0, dequantize_q4_0),
    "Q4_1": (quantize_q4_1, dequantize_q4_1),
    "Q2_K": (quantize_q2_k, dequantize_q2_k),
    "Q3_K": (quantize_q3_k, dequantize_q3_k),
    "IQ4_NL": (quantize_iq4_nl, dequantize_iq4_nl),
    "IQ4_XS": (quantize_iq4_xs, dequantize_iq4_xs),
    "MXFP4": (quantize_mxfp4, dequantize_mxfp4),
    "TQ1_0": (quantize_tq1_0, dequantize_tq1_0),
    "TQ2_0": (quantize_tq2_0, dequantize_tq2_0),
}
# the grid types: quantized here, decoded by gguf-py (see `dequantize`)
_GRID_QUANTIZERS = {
    "IQ3_XXS": quantize_iq3_xxs, "IQ3_S": quantize_iq3_s, "IQ2_XXS": quantize_iq2_xxs, "IQ2_XS": quantize_iq2_xs,
    "IQ2_S": quantize_iq2_s, "IQ1_S": quantize_iq1_s, "IQ1_M": quantize_iq1_m,
}
IMATRIX_NEEDED = ("IQ2_XXS", "IQ2_XS", "IQ1_S")  # ggml quantizes these only with an importance matrix
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _row_layout(qtype: str, n: int) -> int:
    """Bytes per row of n weights; ValueError for an unknown type or a ragged row."""
    if qtype not in _BLOCK_CODECS and qtype not in _FLOAT_TYPES and qtype not in GRID_ENCODINGS:
        raise ValueError(f"unsupported quantization type {qtype!r}; "
                         f"expected one of {sorted(_BLOCK_CODECS) + sorted(_GRID_QUANTIZERS) + list(_FLOAT_TYPES)}")
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
    (ignored by F32, F16, BF16, Q8_0, MXFP4, TQ1_0 and TQ2_0, as in ggml; required by
    IQ2_XXS, IQ2_XS and IQ1_S, as in ggml)."""
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
    if qtype in IMATRIX_NEEDED and not imatrix.size:
        raise ValueError(f"{qtype} needs an importance matrix, as in ggml")
    out = np.empty((*x.shape[:-1], row_bytes), np.uint8)
    quantize_rows = _GRID_QUANTIZERS[qtype] if qtype in _GRID_QUANTIZERS else _BLOCK_CODECS[qtype][0]
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
    if qtype in GRID_ENCODINGS:  # gguf-py's decoder, bit-identical to ggml's
        return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).reshape(*lead, n)
    out = np.empty((*lead, n), np.float32)
    _, dequantize_rows = _BLOCK_CODECS[qtype]
    dequantize_rows(data.reshape(-1, row_bytes), out.reshape(-1, n))
    return out
