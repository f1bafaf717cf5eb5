"""A row of weights times activations: the dot intrinsics and the row operations kernels call.

The int8 dot of a whole row is one `@intrinsic` that emits LLVM IR: `vpmaddubsw` + `vpdpwssd`
on 64 bytes at a time with AVX-512 (K-quants), `vpdpbusd` with AVX-VNNI, `vpmaddubsw` +
`vpmaddwd` with AVX2, and portable vector IR on other CPUs; it unpacks each weight block once
for up to GROUP activations. The exact path dequantizes each weight to the float32 that
`gguf.quants.dequantize` gives (bit for bit). `row_dot`, `rows_times` and `dequantize_into`
are generic over the encoding (a block tag) and the activation, and prefetch the weight
stream PREFETCH_BYTES ahead.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from colibri.formats.encodings import block_size
from colibri.runtime.kernels.activations import (
    ACT_BLOCKS, DOT_TYPES, activation_dot_type, activation_row, float_lanes,
)
from colibri.runtime.kernels.blocks import (
    CACHE_LINE, INTEGER_TOTALS, PREFETCH_BYTES, UNPACKERS, block_loop, dequantized_sub_block, encoding_of, int8_dot,
    k_int8_dots, quantized_encoding,
)
from colibri.runtime.kernels.emitter import Emitter, FLOAT, I64, bf16_to_float, half_to_float, prefetch_line, vec
from colibri.runtime.kernels import int8_tiles
from colibri.runtime.kernels.threads import part_range

F32 = np.float32
_njit = njit(cache=True, nogil=True)

CHUNK = 256  # float weights a row dot prefetches and multiplies at a time
GROUP = 8  # activations multiplied together by the int8 matmul (each weight block unpacked once);
# a remainder of at least GROUP // 2 rows is done as one half group
ROW_TILE = 32  # weight rows the int8 matmul passes each group of activations over (kept in L2)


class Product(NamedTuple):
    """What a kernel takes of a stored [rows, cols] matrix: its block tag, its bytes (uint8)
    and the bytes of a row. Flat (no tuple inside), so that numba's parallel regions take it."""

    tag: np.dtype
    data: np.ndarray
    row_nbytes: int
    rows: int
    cols: int


@_njit
def _prefetch_ahead(w, offset, nbytes):
    """Prefetch the `nbytes` that follow `offset` + PREFETCH_BYTES, a line at a time."""
    for line in range(0, nbytes, CACHE_LINE):
        prefetch_line(w, offset + PREFETCH_BYTES + line)


def _int8_rows_codegen(encoding, count, keep_lanes):
    """codegen of the int8 dot of a row of blocks with `count` activations at once: each
    block is unpacked once for all of them (one loop of vector IR, vector accumulators). With
    `keep_lanes` (`activations.Q8_KLaneActivation`) K-quant blocks keep float lanes everywhere."""
    weights = block_size(encoding)[0]
    k_quant = DOT_TYPES[encoding] == "Q8_K"
    # bytes per block of an activation's int8 values, scales, scaled sums and sums (per 16)
    strides = (weights, weights // ACT_BLOCKS[DOT_TYPES[encoding]] * 4, weights // 16 * 4, weights // 16 * 2)

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        e.int_totals = e.int_totals and not keep_lanes
        start, nblocks = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3))
        bases = [e.pointer(sig.args[i], args[i]) for i in (4, 5, 6, 7)]
        row_bytes = [builder.mul(nblocks, ir.Constant(I64, stride)) for stride in strides]
        lanes = e.multiply_bytes // 4 if k_quant else 8  # of the vector a block's dot returns
        integer = encoding in INTEGER_TOTALS and e.int_totals  # the blocks' floats added one by one (`Block.int_total`)
        zero = ir.Constant(FLOAT, 0.0) if integer else ir.Constant(vec(FLOAT, lanes), [0.0] * lanes)
        totals = [cgutils.alloca_once_value(builder, zero) for _ in range(count)]

        def body(index, block):
            activations = [tuple(e.at(base, builder.add(builder.mul(ir.Constant(I64, k), size),
                                                        builder.mul(index, ir.Constant(I64, stride))))
                                 for base, size, stride in zip(bases, row_bytes, strides))
                           for k in range(count)]
            if k_quant:  # each sub-block multiplied by all activations at once
                sums = k_int8_dots(e, block, activations, [builder.load(total) for total in totals])
            else:
                sums = [int8_dot(e, block, *act, builder.load(total)) for act, total in zip(activations, totals)]
            for total, value in zip(totals, sums):
                builder.store(value, total)

        block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), nblocks, body)
        if integer:
            dots = [builder.load(total) for total in totals]
        else:
            dots = [e.hsum(e.fold8(builder.load(total))) for total in totals]
        return dots[0] if count == 1 else context.make_tuple(builder, sig.return_type, dots)

    return codegen


def _row_dots_int8_intrinsic(count, keep_lanes):
    @intrinsic
    def row_dots_int8(typingctx, tag, w, offset, nblocks, xq, xd, xs, xb):
        """float32 dot of the `nblocks` blocks at byte `offset` of `w` with the first `count`
        rows of int8 activations (xq, xd, xs, xb) at once: a float32, or a tuple of them."""
        encoding = quantized_encoding(tag)
        if encoding is None:
            return None
        result = types.float32 if count == 1 else types.UniTuple(types.float32, count)
        return result(tag, w, offset, nblocks, xq, xd, xs, xb), _int8_rows_codegen(encoding, count, keep_lanes)

    return row_dots_int8


# (activations at once, float lanes) -> the row dot
_ROW_DOTS = {(count, lanes): _row_dots_int8_intrinsic(count, lanes)
             for count in (1, GROUP // 2, GROUP) for lanes in (False, True)}


@intrinsic
def _row_dot_float(typingctx, tag, w, offset, nblocks, x):
    """float32 dot of the `nblocks` blocks at byte `offset` of `w` with float32 x, each
    weight dequantized exactly (exact path, one activation)."""
    encoding = quantized_encoding(tag)
    if encoding is None:
        return None
    weights = block_size(encoding)[0]

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        start, count = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3))
        act = e.pointer(sig.args[4], args[4])
        total = cgutils.alloca_once_value(builder, ir.Constant(vec(FLOAT, 32), [0.0] * 32))

        def body(index, block):
            first = e.at(act, builder.mul(index, ir.Constant(I64, weights * 4)))
            terms = [(dequantized_sub_block(e, block, j), e.load(first, 128 * j, FLOAT, 32))
                     for j in range(len(block.levels))]
            builder.store(builder.fadd(builder.load(total), e.weighted_sum(terms)), total)

        block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), count, body)
        return e.hsum(e.fold8(builder.load(total)))

    return types.float32(tag, w, offset, nblocks, x), codegen


@intrinsic
def _dequantize_blocks(typingctx, tag, w, offset, nblocks, out):
    """Dequantize the `nblocks` blocks at byte `offset` of `w` into out[:nblocks * block weights]."""
    encoding = quantized_encoding(tag)
    if encoding is None:
        return None

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        start, count = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3))
        values = e.pointer(sig.args[4], args[4])
        block_floats = block_size(encoding)[0] * 4

        def body(index, block):
            first = builder.mul(index, ir.Constant(I64, block_floats))
            for j in range(len(block.levels)):
                target = builder.bitcast(e.at(values, builder.add(first, ir.Constant(I64, 128 * j))),
                                         vec(FLOAT, 32).as_pointer())
                builder.store(dequantized_sub_block(e, block, j), target, align=4)

        block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), count, body)
        return context.get_dummy_value()

    return types.void(tag, w, offset, nblocks, out), codegen


@_njit
def _identity(value):
    return value


# float encodings: (how numpy views the bytes, float32 of one element)
_FLOAT_ELEMENTS = {"F32": (np.float32, _identity), "F16": (np.uint16, half_to_float),
                   "BF16": (np.uint16, bf16_to_float)}


def _dequantize_impl(encoding):
    """numba implementation of dequantize_into for one encoding."""
    if encoding in _FLOAT_ELEMENTS:
        dtype, convert = _FLOAT_ELEMENTS[encoding]
        itemsize = np.dtype(dtype).itemsize

        def impl(tag, w, offset, count, out):
            _prefetch_ahead(w, offset, itemsize * count)
            elements = w[offset:offset + itemsize * count].view(dtype)
            for i in range(count):
                out[i] = convert(elements[i])
    else:
        weights = block_size(encoding)[0]

        def impl(tag, w, offset, count, out):
            _dequantize_blocks(tag, w, offset, count // weights, out)
    return impl


def dequantize_into(tag, w, offset, count, out):
    """Dequantize `count` weights (whole blocks) from byte `offset` of `w` into out[:count]."""


@overload(dequantize_into)
def _dequantize_into_overload(tag, w, offset, count, out):
    encoding = encoding_of(tag)
    return None if encoding is None else _dequantize_impl(encoding)


def row_dot(tag, w, offset, cols, act):
    """float32 dot of the row of `cols` weights at byte `offset` of `w` with one activation
    (a float32 vector, or an int8 (q, d, sums) tuple)."""


@overload(row_dot, jit_options={"fastmath": True})
def _row_dot_overload(tag, w, offset, cols, act):
    encoding = encoding_of(tag)
    if encoding is None:
        return None
    if encoding in UNPACKERS:
        weights = block_size(encoding)[0]
        if activation_dot_type(act) is not None:
            if activation_dot_type(act) != DOT_TYPES[encoding]:
                return None
            one = _ROW_DOTS[1, float_lanes(act)]
            return lambda tag, w, offset, cols, act: one(tag, w, offset, cols // weights, act.q, act.d, act.sums,
                                                         act.bsums)
        return lambda tag, w, offset, cols, act: _row_dot_float(tag, w, offset, cols // weights, act)
    dtype, convert = _FLOAT_ELEMENTS[encoding]
    itemsize = np.dtype(dtype).itemsize

    def float_weights(tag, w, offset, cols, act):
        elements = w[offset:offset + itemsize * cols].view(dtype)
        total = F32(0.0)
        for first in range(0, cols, CHUNK):
            _prefetch_ahead(w, offset + itemsize * first, itemsize * CHUNK)
            chunk, x = elements[first:first + CHUNK], act[first:first + CHUNK]
            for i in range(chunk.size):
                total += convert(chunk[i]) * x[i]
        return total
    return float_weights


def rows_times(tag, w, first, stop, row_nbytes, cols, act, out):
    """out[:, first:stop] = rows first..stop-1 of `w` times each of the n activations `act`
    (float32 [n, cols], or an int8 activation of [n, ...] arrays)."""


@overload(rows_times)
def _rows_times_overload(tag, w, first, stop, row_nbytes, cols, act, out):
    encoding = encoding_of(tag)
    if encoding is None:
        return None
    weights = block_size(encoding)[0]
    if activation_dot_type(act) is not None:
        if activation_dot_type(act) != DOT_TYPES[encoding]:
            return None

        tiles = encoding in INTEGER_TOTALS and int8_tiles.available() and not float_lanes(act)
        dot_one, dot_half, dot_group = (_ROW_DOTS[count, float_lanes(act)] for count in (1, GROUP // 2, GROUP))

        def int8_impl(tag, w, first, stop, row_nbytes, cols, act, out):
            if tiles and out.shape[0] >= int8_tiles.MIN_ACTIVATIONS:
                int8_tiles.tiled_rows_times(tag, w, first, stop, row_nbytes, cols, act, out)
                return
            q, d, s, sb = act
            n, nblocks = out.shape[0], cols // weights
            grouped = n - n % GROUP
            half = n - grouped >= GROUP // 2
            # A tile of rows stays in L2 while each group of activations, in L1, passes over it.
            for tile in range(first, stop, ROW_TILE):
                end = min(tile + ROW_TILE, stop)
                for i in range(0, grouped, GROUP):  # each block unpacked once for GROUP activations
                    for r in range(tile, end):
                        dots = dot_group(tag, w, r * row_nbytes, nblocks, q[i:], d[i:], s[i:], sb[i:])
                        for k in range(GROUP):
                            out[i + k, r] = dots[k]
                if half:
                    for r in range(tile, end):
                        dots = dot_half(tag, w, r * row_nbytes, nblocks, q[grouped:], d[grouped:], s[grouped:],
                                        sb[grouped:])
                        for k in range(GROUP // 2):
                            out[grouped + k, r] = dots[k]
                for i in range(grouped + half * (GROUP // 2), n):
                    for r in range(tile, end):
                        out[i, r] = dot_one(tag, w, r * row_nbytes, nblocks, q[i], d[i], s[i], sb[i])
        return int8_impl

    def float_impl(tag, w, first, stop, row_nbytes, cols, act, out):
        # each activation through `row_dot`, as one alone would be: a row's result must not
        # depend on the rows beside it (a batch of sequences gives each the bits it gets alone)
        for r in range(first, stop):
            for i in range(out.shape[0]):
                out[i, r] = row_dot(tag, w, r * row_nbytes, cols, act[i])
    return float_impl


@_njit
def rows_per_head(t, nthreads, matrix, act, heads, stride, first, out):
    """Thread t's share of a product with a slice of `matrix` per head, out [heads, n, rows]:
    head h's n activations (rows h * n.. of `act`) times rows first + h * stride.., each
    head's rows unpacked once for GROUP of them (MLA's absorbed projections)."""
    tag, w, row_nbytes, cols = matrix.tag, matrix.data, matrix.row_nbytes, matrix.cols
    n, rows = out.shape[1], out.shape[2]
    lo, hi = part_range(heads * rows, nthreads, t, 1)
    for h in range(heads):
        start, stop = max(lo, h * rows), min(hi, (h + 1) * rows)
        if start < stop:
            rows_times(tag, w[(first + h * stride) * row_nbytes:], start - h * rows, stop - h * rows, row_nbytes, cols,
                       activation_row(act, slice(h * n, (h + 1) * n)), out[h])
