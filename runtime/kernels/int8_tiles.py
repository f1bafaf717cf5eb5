"""Many int8 activations times a K-quant matrix on tiles: the products of prompts and batches.

Where the CPU has AVX-512 VNNI, `rows_times` multiplies MIN_ACTIVATIONS or more activations
(`activations.Q8_KActivation`: a prompt's, or a batch step's or sweep's rows) with a Q4_K, Q5_K
or Q6_K matrix (`blocks.INTEGER_TOTALS`) here rather than a row at a time:
- the activations are interleaved, 4 values of each of 16 activations in every 64 bytes
  (`pack_activations`), PACKED_BYTES of them at a time (kept in cache while every weight row
  passes over them: a prompt pass of many documents brings thousands);
- for each such share, PANEL_ROWS weight rows at a time are unpacked: their levels as bytes,
  their integer scales and mins, d and dmin (`_unpack_row`);
- a tile of TILE_ROWS rows by 16 activations then takes one vpdpbusd per 4 weights of a row
  for all 16 activations (`_tile`), where a row dot takes two instructions per 64 weights for
  each activation.
A block's product stays integer to its end and becomes a float by `blocks.block_total`, added
in block order, as the row dots of such activations do (`unpacked.Block`, `int_total`): a row
gets the same bits on either path, however a prompt is cut.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from colibri.runtime.kernels.blocks import INTEGER_TOTALS, KEEP_ORDER, block_loop, block_total, encoding_of
from colibri.runtime.kernels.emitter import FLOAT, I8, I32, I64, Emitter, target_isa, vec

_njit = njit(cache=True, nogil=True)

WEIGHTS = 256  # a K-quant block's
GROUPS = WEIGHTS // 4  # vpdpbusd's 4-weight groups a block
ACTS = 16  # activations a tile takes (int32 lanes of a 64-byte vector)
TILE_ROWS = 8  # weight rows a tile takes
PANEL_ROWS = 32  # weight rows unpacked at a time (multiple of TILE_ROWS; their levels stay in L2)
MIN_ACTIVATIONS = 12  # activations from which a product takes the tiles (below, most of a band is padding)
PACKED_BYTES = 4 << 20  # the packed activations a thread multiplies at a time (well inside a shared L3)


def available() -> bool:
    """Whether this process's kernels take the tiles (the CPU numba compiles for has AVX-512 VNNI)."""
    return target_isa().vnni512


class Packed(NamedTuple):
    """Activations interleaved for the tiles, in bands of ACTS (the last padded with zeros):
    codes int32 [bands, blocks, GROUPS, ACTS] (4 int8 values each), bsums int32 [bands,
    blocks, 16, ACTS] (the sums of each 16 values), xd float32 [bands, blocks, ACTS]."""

    codes: np.ndarray
    bsums: np.ndarray
    xd: np.ndarray


class Panel(NamedTuple):
    """PANEL_ROWS weight rows unpacked: levels uint8 [rows, cols], integer scales int32 [rows,
    blocks, 16] (one per 16 or 32 weights), mins int32 [rows, blocks, 8], d and dmin float32
    [rows, blocks]."""

    levels: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    d: np.ndarray
    dmin: np.ndarray


@_njit
def activations_a_share(cols):
    """How many activations of `cols` values `tiled_rows_times` packs at a time: as many whole
    bands as PACKED_BYTES holds (codes, bsums and xd; at least one band)."""
    nblocks = cols // WEIGHTS
    packed = nblocks * (GROUPS + 16 + 1) * 4
    return max(PACKED_BYTES // packed // ACTS, 1) * ACTS


@_njit
def pack_activations(act, first, n, nblocks):
    """The n Q8_K activations first.. of `act` (cols = nblocks * WEIGHTS) as `Packed`."""
    bands = (n + ACTS - 1) // ACTS
    codes = np.zeros((bands, nblocks, GROUPS, ACTS), np.int32)
    bsums = np.zeros((bands, nblocks, 16, ACTS), np.int32)
    xd = np.zeros((bands, nblocks, ACTS), np.float32)
    for i in range(n):
        band, lane = i // ACTS, i % ACTS
        quads = np.ascontiguousarray(act.q[first + i]).view(np.int32)
        for b in range(nblocks):
            for g in range(GROUPS):
                codes[band, b, g, lane] = quads[b * GROUPS + g]
            for u in range(16):
                bsums[band, b, u, lane] = act.bsums[first + i, b * 16 + u]
            xd[band, b, lane] = act.d[first + i, b]
    return Packed(codes, bsums, xd)


def _fields(e, sig_tuple, value):
    """i8* to each array of a named tuple of arrays."""
    members = cgutils.unpack_tuple(e.b, value, len(sig_tuple.types))
    return [e.pointer(kind, member) for kind, member in zip(sig_tuple.types, members)]


@intrinsic
def _unpack_row(typingctx, tag, w, offset, nblocks, panel, r):
    """Unpack the `nblocks` blocks at byte `offset` of `w` into row r of `panel`."""
    encoding = encoding_of(tag)
    if encoding not in INTEGER_TOTALS:
        return None

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        start, count, row = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3, 5))
        levels, scales, mins, d, dmin = _fields(e, sig.args[4], args[4])
        first = builder.mul(row, count)  # the row's first block

        def body(index, block):
            at = builder.add(first, index)
            base = builder.mul(at, ir.Constant(I64, WEIGHTS))
            for j, level in enumerate(block.levels):
                builder.store(level, builder.bitcast(e.at(levels, builder.add(base, ir.Constant(I64, 32 * j))),
                                                     vec(I8, 32).as_pointer()), align=1)
            wide = builder.sext(block.int_scales, vec(I32, 16))
            builder.store(wide, builder.bitcast(e.at(scales, builder.mul(at, ir.Constant(I64, 64))),
                                                vec(I32, 16).as_pointer()), align=1)
            builder.store(block.d, builder.bitcast(e.at(d, builder.mul(at, ir.Constant(I64, 4))), FLOAT.as_pointer()))
            if block.dmin is not None:
                per32 = builder.sext(e.pick(block.int_mins16, range(0, 16, 2)), vec(I32, 8))
                builder.store(per32, builder.bitcast(e.at(mins, builder.mul(at, ir.Constant(I64, 32))),
                                                     vec(I32, 8).as_pointer()), align=1)
                builder.store(block.dmin, builder.bitcast(e.at(dmin, builder.mul(at, ir.Constant(I64, 4))),
                                                          FLOAT.as_pointer()))

        block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), count, body)
        return context.get_dummy_value()

    return types.void(tag, w, offset, nblocks, panel, r), codegen


def _dpbusd(e, acc, unsigned, signed):
    """acc <16 x i32> plus, in lane m, the sum of the 4 unsigned * signed bytes of lane m."""
    return e.call("llvm.x86.avx512.vpdpbusd.512", acc.type, acc, unsigned, signed)


@intrinsic
def _tile(typingctx, tag, panel, r0, packed, band, nblocks, out):
    """out float32 [TILE_ROWS * ACTS] = rows r0.. of `panel` times band `band` of `packed`,
    every block's product made and added as `blocks.k_int8_dots` makes and adds it."""
    encoding = encoding_of(tag)
    if encoding not in INTEGER_TOTALS:
        return None

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        b = builder
        row0, band_index, count = (context.cast(b, args[i], sig.args[i], types.int64) for i in (2, 4, 5))
        levels, scales, mins, d, dmin = _fields(e, sig.args[1], args[1])
        codes, bsums, xds = _fields(e, sig.args[3], args[3])
        result = e.pointer(sig.args[6], args[6])
        units, bias, has_mins = (16, 32, False) if encoding == "Q6_K" else (8, 0, True)  # units: scales a block
        per_unit = GROUPS // units
        zero_f, zero_i = ir.Constant(vec(FLOAT, ACTS), None), ir.Constant(vec(I32, ACTS), None)
        totals = [cgutils.alloca_once_value(b, zero_f) for _ in range(TILE_ROWS)]
        rows = [b.add(row0, ir.Constant(I64, t)) for t in range(TILE_ROWS)]

        def i64(value):
            return ir.Constant(I64, value)

        def load_vector(base, offset, element=I32):
            return e.load(base, offset, element, ACTS)

        with cgutils.for_range(b, count) as loop:
            block = loop.index
            at = b.add(b.mul(band_index, count), block)
            act = e.at(codes, b.mul(at, i64(GROUPS * ACTS * 4)))
            sums = e.at(bsums, b.mul(at, i64(16 * ACTS * 4)))
            xd = load_vector(e.at(xds, b.mul(at, i64(ACTS * 4))), 0, FLOAT)
            weights = [b.add(b.mul(r, b.mul(count, i64(WEIGHTS))), b.mul(block, i64(WEIGHTS))) for r in rows]
            blocks = [b.add(b.mul(r, count), block) for r in rows]
            isums = [zero_i] * TILE_ROWS
            for u in range(units):
                parts = [zero_i] * TILE_ROWS
                for g in range(u * per_unit, (u + 1) * per_unit):
                    x = load_vector(act, g * ACTS * 4)
                    for t in range(TILE_ROWS):
                        quad = e.load(levels, b.add(weights[t], i64(4 * g)), I32)
                        parts[t] = _dpbusd(e, parts[t], e.splat(quad, ACTS), x)
                if bias:  # levels were used without their bias: take bias * the sums of x off
                    taken = b.mul(load_vector(sums, u * ACTS * 4), e.const(I32, ACTS, bias))
                    parts = [b.sub(part, taken) for part in parts]
                for t in range(TILE_ROWS):
                    scale = e.load(scales, b.add(b.mul(blocks[t], i64(64)), i64(4 * u)), I32)
                    isums[t] = b.add(isums[t], b.mul(parts[t], e.splat(scale, ACTS)))
            imins = [None] * TILE_ROWS
            if has_mins:
                per32 = [b.add(load_vector(sums, 2 * s * ACTS * 4), load_vector(sums, (2 * s + 1) * ACTS * 4))
                         for s in range(8)]
                for t in range(TILE_ROWS):
                    imin = zero_i
                    for s in range(8):
                        low = e.load(mins, b.add(b.mul(blocks[t], i64(32)), i64(4 * s)), I32)
                        imin = b.add(imin, b.mul(per32[s], e.splat(low, ACTS)))
                    imins[t] = imin
            for t in range(TILE_ROWS):
                scale = e.load(d, b.mul(blocks[t], i64(4)), FLOAT)
                low = e.load(dmin, b.mul(blocks[t], i64(4)), FLOAT) if has_mins else None
                value = block_total(e, scale, low, isums[t], imins[t], xd)
                b.store(b.fadd(b.load(totals[t]), value, flags=KEEP_ORDER), totals[t])
        for t in range(TILE_ROWS):
            b.store(b.load(totals[t]), b.bitcast(e.at(result, i64(t * ACTS * 4)), vec(FLOAT, ACTS).as_pointer()),
                    align=4)
        return context.get_dummy_value()

    return types.void(tag, panel, r0, packed, band, nblocks, out), codegen


@_njit
def tiled_rows_times(tag, w, first, stop, row_nbytes, cols, act, out):
    """out[:, first:stop] = rows first..stop-1 of `w` times each of the n Q8_K activations
    `act` (as `rows.rows_times`, the same bits)."""
    n, nblocks = out.shape[0], cols // WEIGHTS
    share = activations_a_share(cols)
    panel = Panel(np.zeros(PANEL_ROWS * cols, np.uint8), np.zeros(PANEL_ROWS * nblocks * 16, np.int32),
                  np.zeros(PANEL_ROWS * nblocks * 8, np.int32), np.zeros(PANEL_ROWS * nblocks, np.float32),
                  np.zeros(PANEL_ROWS * nblocks, np.float32))
    tile = np.empty(TILE_ROWS * ACTS, np.float32)
    for a0 in range(0, n, share):
        m = min(share, n - a0)
        packed = pack_activations(act, a0, m, nblocks)
        for top in range(first, stop, PANEL_ROWS):
            count = min(PANEL_ROWS, stop - top)
            for r in range(count):
                _unpack_row(tag, w, (top + r) * row_nbytes, nblocks, panel, r)
            for band in range((m + ACTS - 1) // ACTS):
                lanes = min(ACTS, m - band * ACTS)
                for r0 in range(0, count, TILE_ROWS):
                    _tile(tag, panel, r0, packed, band, nblocks, tile)
                    for t in range(min(TILE_ROWS, count - r0)):
                        for lane in range(lanes):
                            out[a0 + band * ACTS + lane, top + r0 + t] = tile[t * ACTS + lane]
