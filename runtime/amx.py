"""Intel AMX tile products for prompts: bfloat16 weights times bfloat16 activations, float32 sums.

A prompt multiplies every weight with many tokens, so its products are bound by arithmetic,
not by memory. Sapphire Rapids and later Xeons have AMX: eight tile registers of 16 rows x
64 bytes and `tdpbf16ps`, which adds a 16 x 32 bfloat16 tile times a 32 x 16 one into a 16 x 16
float32 tile (8192 multiply-adds per instruction, many times what the AVX-512 int8 kernels do;
bench/RESULTS.md has the measured rates). The kernels in `runtime/kernels/matrices.py`
dequantize a block of 32 weight rows to bfloat16 once and pass every token over it with
`block_product`.

Layouts (bfloat16 as uint16 bits):
- weights: 32 rows x cols, row-major, each row followed by ROW_PAD unused values (a tile is
  16 rows x 32 columns);
- activations (`TileActivation.packed`): uint32 [tokens / 16, cols / 2, 16], a pair of
  columns of 16 tokens per row of 64 bytes, as tdpbf16ps takes its second operand; tokens
  padded with zeros to a multiple of 32;
- sums: float32 [32 rows, padded tokens].

Linux gives a process the AMX state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`),
which `available` makes. The instructions are inline assembly with fixed tile registers:
tmm0-3 the four 16 x 16 sums of a 32 x 32 output block, tmm4-5 weights, tmm6-7 activations.
Rounding to bfloat16 keeps 8 bits of each weight and activation: the products' error is
about 2.5e-3 of the output's max-abs, below the int8 path's (`kernels.FAST_PATH_TOLERANCE`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from colibri.runtime.kernels.threads import thread_count

BLOCK = 32  # weight rows and tokens of one output block (2 x 2 tiles)
COLUMNS = 32  # columns of one tile step (16 bfloat16 pairs)
K_BLOCK = 512  # columns of weights kept in L1 while every token passes over them
ROW_PAD = 32  # bfloat16 after each row of a weight block: rows 4 KB apart would share an L1 set
MIN_TOKENS = 16  # tokens from which a product takes this path (fewer go to the int8 kernels)

llvmlite.binding.initialize_native_asmparser()  # the tile instructions are inline assembly

_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158
_I8, _I64 = ir.IntType(8), ir.IntType(64)
_BYTE_PTR = _I8.as_pointer()


@functools.cache
def available() -> bool:
    """Whether this process can use AMX bfloat16 tiles: numba compiles for the host CPU, which
    has them, Linux grants the tile state, and COLIBRI_AMX is not 0."""
    if os.environ.get("COLIBRI_AMX", "1") == "0" or platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    if numba.config.CPU_NAME not in (None, "host"):
        return False  # compiling for another CPU (tests do), which may lack AMX
    features = llvmlite.binding.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-bf16")):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


# ------------------------------------------------------------------ tile instructions


def _pointer(context, builder, arraytype, array, byte_offset=None):
    data = builder.bitcast(context.make_array(arraytype)(context, builder, array).data, _BYTE_PTR)
    return data if byte_offset is None else builder.gep(data, [byte_offset])


def _asm(builder, text, operands=()):
    """Inline assembly with side effects that reads `operands` and may touch memory."""
    constraints = ",".join(["r"] * len(operands) + ["~{memory}"])
    builder.asm(ir.FunctionType(ir.VoidType(), [o.type for o in operands]), text, constraints, list(operands), True)


@intrinsic
def _tile_config(typingctx, config):
    """ldtilecfg: every tile 16 rows x 64 bytes (`config`, a 64-byte uint8 array)."""
    def codegen(context, builder, sig, args):
        _asm(builder, "ldtilecfg ($0)", [_pointer(context, builder, sig.args[0], args[0])])
        return context.get_dummy_value()
    return types.void(config), codegen


@intrinsic
def _tile_release(typingctx):
    """tilerelease: back to the initial state, so that context switches save no tiles."""
    def codegen(context, builder, sig, args):
        _asm(builder, "tilerelease")
        return context.get_dummy_value()
    return types.void(), codegen


def _quad(context, builder, arraytype, array, byte_offset, row_stride):
    """Addresses of the four 16 x 16 float32 tiles of a 32 x 32 block at `byte_offset`."""
    first = _pointer(context, builder, arraytype, array, byte_offset)
    below = builder.gep(first, [builder.mul(row_stride, ir.Constant(_I64, 16))])
    right = ir.Constant(_I64, 64)
    return first, builder.gep(first, [right]), below, builder.gep(below, [right])


def _sums_mover(instruction: str):
    """An intrinsic (sums, byte_offset, row_stride) that applies `instruction` ("{i}": the tile,
    "${i}": its address, "$4": the row stride) to tmm0-3 and the four 16 x 16 tiles of the 32 x
    32 float32 block of `sums` at `byte_offset`, rows `row_stride` bytes apart."""
    @intrinsic
    def move(typingctx, sums, byte_offset, row_stride):
        def codegen(context, builder, sig, args):
            tiles = _quad(context, builder, sig.args[0], args[0], args[1], args[2])
            _asm(builder, "\n\t".join(instruction.format(i=i) for i in range(4)), [*tiles, args[2]])
            return context.get_dummy_value()
        return types.void(sums, types.int64, types.int64), codegen
    return move


_sums_load = _sums_mover("tileloadd (${i},$4,1), %tmm{i}")
_sums_store = _sums_mover("tilestored %tmm{i}, (${i},$4,1)")


@intrinsic
def _sums_zero(typingctx):
    def codegen(context, builder, sig, args):
        _asm(builder, "\n\t".join(f"tilezero %tmm{i}" for i in range(4)))
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _tile_step(typingctx, weights, w_offset, w_stride, acts, a_offset, a_group_bytes):
    """tmm0-3 += the 32 x 32 bfloat16 weights at `w_offset` (rows `w_stride` bytes apart) times
    the 32 columns of 2 x 16 packed tokens at `a_offset` (the second 16 `a_group_bytes` on)."""
    def codegen(context, builder, sig, args):
        upper = _pointer(context, builder, sig.args[0], args[0], args[1])
        lower = builder.gep(upper, [builder.mul(args[2], ir.Constant(_I64, 16))])
        left = _pointer(context, builder, sig.args[3], args[3], args[4])
        right = builder.gep(left, [args[5]])
        text = ["tileloadd ($0,$4,1), %tmm4", "tileloadd ($2,$5,1), %tmm6",
                "tdpbf16ps %tmm6, %tmm4, %tmm0", "tileloadd ($3,$5,1), %tmm7",
                "tdpbf16ps %tmm7, %tmm4, %tmm1", "tileloadd ($1,$4,1), %tmm5",
                "tdpbf16ps %tmm6, %tmm5, %tmm2", "tdpbf16ps %tmm7, %tmm5, %tmm3"]
        _asm(builder, "\n\t".join(text), [upper, lower, left, right, args[2], ir.Constant(_I64, 64)])
        return context.get_dummy_value()
    return types.void(weights, types.int64, types.int64, acts, types.int64, types.int64), codegen


# ------------------------------------------------------------------ numba helpers


@njit(cache=True, nogil=True, inline="always")
def _bf16_bits(bits):
    """The bfloat16 nearest the float32 whose bits are `bits` (uint32; ties to even)."""
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(cache=True, nogil=True)
def round_row(values, out):
    """out[:] = values (float32) rounded to bfloat16 bits; vectorized."""
    bits = values.view(np.uint32)
    for i in range(bits.size):
        out[i] = np.uint16(_bf16_bits(bits[i]))


@njit(cache=True, nogil=True, parallel=True)
def _pack(values, nthreads):
    n, cols = values.shape
    groups = (n + BLOCK - 1) // BLOCK * BLOCK // 16
    packed = np.zeros((groups, cols // 2, 16), np.uint32)
    bits = values.view(np.uint32)
    for t in prange(nthreads):
        for group in range(groups * t // nthreads, groups * (t + 1) // nthreads):
            for lane in range(min(16, n - 16 * group)):
                row, out = bits[16 * group + lane], packed[group]
                for p in range(cols // 2):
                    out[p, lane] = _bf16_bits(row[2 * p]) | (_bf16_bits(row[2 * p + 1]) << np.uint32(16))
    return packed


class TileActivation:
    """Activations as the tile kernels take them: float32 rows [n, cols], rounded to bfloat16
    and packed (see the module doc) on first use, once for every matrix that multiplies them."""

    def __init__(self, rows: np.ndarray):
        self.rows, self._packed = rows, None

    def take(self, index) -> "TileActivation":
        return TileActivation(self.rows[index])

    @property
    def packed(self) -> np.ndarray:
        if self._packed is None:
            self._packed = _pack(np.ascontiguousarray(self.rows), thread_count())
        return self._packed


@njit(cache=True, nogil=True)
def tile_config():
    """The tile configuration every kernel here uses (palette 1, 8 tiles of 16 x 64 bytes);
    load it with `start` on each thread before its first tile instruction."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    for t in range(8):
        config[16 + 2 * t] = 64  # bytes per row (little-endian uint16)
        config[48 + t] = 16  # rows
    return config


@njit(cache=True, nogil=True)
def start(config):
    _tile_config(config)


@njit(cache=True, nogil=True)
def finish():
    _tile_release()


@njit(cache=True, nogil=True)
def block_product(weights, packed, sums):
    """sums [32, padded n] = weights (bfloat16 bits [32, cols + ROW_PAD]) times the packed
    activations' tokens, columns K_BLOCK at a time so that the weights' slice stays in L1."""
    cols = weights.shape[1] - ROW_PAD
    tokens = sums.shape[1]
    w_stride, s_stride, group_bytes = 2 * weights.shape[1], 4 * tokens, 32 * cols
    for k_first in range(0, cols, K_BLOCK):
        k_stop = min(k_first + K_BLOCK, cols)
        for token in range(0, tokens, BLOCK):
            if k_first == 0:
                _sums_zero()
            else:
                _sums_load(sums, 4 * token, s_stride)
            for k in range(k_first, k_stop, COLUMNS):
                _tile_step(weights, 2 * k, w_stride, packed, (token // 16) * group_bytes + 32 * k, group_bytes)
            _sums_store(sums, 4 * token, s_stride)
