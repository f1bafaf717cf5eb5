"""The quantized block types in LLVM IR: block tags, unpackers, and a block's share of a dot.

Each quantized block type is described once, by the function that unpacks a block into IR
values (`UNPACKERS`); the int8 dot (`int8_dot`, `k_int8_dot`), the exact dot and the
dequantizer (`dequantized_sub_block`) are built from it. An encoding reaches compiled code as
a compile-time tag, the numpy dtype of one of its blocks (`BLOCK_TAGS`), so numba compiles one
specialization per encoding, and only for the encodings a program uses.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils

from colibri.formats.encodings import ENCODINGS, IQ4_VALUES, MXFP4_VALUES, block_size
from colibri.runtime.kernels.activations import FAST_ENCODINGS
from colibri.runtime.kernels.emitter import CONTRACT, FLOAT, I1, I8, I16, I32, I64, vec
from colibri.runtime.kernels.grid_blocks import GRID_UNPACKERS
from colibri.runtime.kernels.unpacked import Block

# multiplied as one integer a block (`Block.int_total`) where the CPU has AVX-512 VNNI, in every
# product but a token decoded alone's, so that the int8 tiles (`int8_tiles`) give a row the
# bits of its row dots; that token (`activations.Q8_KLaneActivation`, `Emitter.int_totals`) and
# other CPUs keep float lanes
INTEGER_TOTALS = ("Q4_K", "Q5_K", "Q6_K")
PREFETCH_BYTES = 4096  # how far ahead of the current block the weight stream is prefetched
CACHE_LINE = 64


def _block_tag(encoding: str) -> np.dtype:
    """The dtype of one block of `encoding`: a record named after it."""
    return np.dtype([(encoding, np.uint8, (block_size(encoding)[1],))])


BLOCK_TAGS = {encoding: _block_tag(encoding) for encoding in ENCODINGS}


def encoding_of(tag) -> str | None:
    """The encoding named by a block tag's numba type, or None for anything else."""
    if isinstance(tag, types.DType) and isinstance(tag.dtype, types.Record):
        name = next(iter(tag.dtype.fields))
        return name if name in BLOCK_TAGS else None
    return None


def _k_scales(e, block, offset):
    """IR: the 6-bit scales (lanes 0-7) and mins (lanes 8-15) of a Q4_K / Q5_K block as a
    <16 x i8>, unpacked as ggml does from the 12 bytes at `offset` (sub-blocks 0-3 in the low
    bits of bytes 0-7, sub-blocks 4-7 in bytes 8-11 and the top bits of bytes 0-7). The three
    words are unpacked side by side in one vector (a few vector instructions rather than a
    dozen scalar ones and their inserts); the load's fourth word, the next 4 bytes of the
    block, is not used."""
    b = e.b
    words = e.load(block, offset, I32, 4)  # u0, u1, u2, -

    def constants(*values):
        return ir.Constant(vec(I32, 4), [ir.Constant(I32, v) for v in values])

    # scales 0-3: u0 & 3F; scales 4-7: (u2 & 0F) | tops(u0); mins 0-3: u1 & 3F;
    # mins 4-7: (u2 >> 4 & 0F) | tops(u1), where tops(u) moves bits 6-7 of each byte to 4-5
    low = b.and_(b.lshr(e.pick(words, [0, 2, 1, 2]), constants(0, 0, 0, 4)),
                 constants(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F))
    tops = b.and_(b.lshr(e.pick(words, [0, 0, 1, 1]), constants(2, 2, 2, 2)),
                  constants(0, 0x30303030, 0, 0x30303030))
    return b.bitcast(b.or_(low, tops), vec(I8, 16))


def _k_block(e, block, levels):
    """A Q4_K / Q5_K block from its `levels`: d, dmin (f16) at bytes 0 and 2, the packed
    scales and mins at byte 4."""
    b = e.b
    packed = _k_scales(e, block, 4)
    values = b.uitofp(packed, vec(FLOAT, 16))
    both = e.halves_to_floats(e.load(block, 0, I16, 2))  # d and dmin in one conversion
    d, dmin = (b.extract_element(both, ir.Constant(I32, i)) for i in range(2))
    offsets = b.fneg(b.fmul(e.splat(dmin), e.pick(values, range(8, 16))))
    int_scales = b.zext(packed, vec(I16, 16))
    return Block(levels, b.fmul(e.splat(d), e.pick(values, range(8))), offsets=offsets,
                  d=d, int_scales=int_scales, pairs_per_scale=16,
                  offsets16=e.pick(offsets, [j // 2 for j in range(16)]),
                  int_total=e.int_totals, dmin=dmin, int_mins16=e.pick(int_scales, [8 + j // 2 for j in range(16)]))


def _unpack_q4_k(e, block):
    """Q4_K (144 bytes): d, dmin (f16); 12 bytes of 6-bit scales and mins; 128 bytes of
    nibbles, low nibbles of bytes 32g.. for sub-block 2g, high nibbles for 2g + 1."""
    return _k_block(e, block, [q for g in range(4) for q in e.nibbles(e.load(block, 16 + 32 * g, I8, 32))])


def _unpack_q5_k(e, block):
    """Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits (bit j for sub-block j)
    between the scales and the nibbles."""
    b = e.b
    high_bits = e.load(block, 16, I8, 32)
    levels = []
    for g in range(4):
        for j, q in zip((2 * g, 2 * g + 1), e.nibbles(e.load(block, 48 + 32 * g, I8, 32))):
            fifth = b.and_(b.lshr(high_bits, e.const(I8, 32, j)), e.const(I8, 32, 1))
            levels.append(b.or_(q, b.shl(fifth, e.const(I8, 32, 4))))
    return _k_block(e, block, levels)


def _unpack_q6_k(e, block):
    """Q6_K (210 bytes): 128 bytes of low nibbles (ql), 64 of 2-bit high parts (qh), 16 int8
    scales (one per 16 weights), d (f16) last. Levels 0..63 stand for -32..31."""
    b = e.b
    levels = []
    for h in range(2):  # 128 weights: sub-blocks from ql[0:32] low, ql[32:64] low, then high
        a_lo, a_hi = e.nibbles(e.load(block, 64 * h, I8, 32))
        b_lo, b_hi = e.nibbles(e.load(block, 64 * h + 32, I8, 32))
        high = e.load(block, 128 + 32 * h, I8, 32)
        for low, shift in ((a_lo, 0), (b_lo, 2), (a_hi, 4), (b_hi, 6)):
            two_bits = b.and_(b.lshr(high, e.const(I8, 32, shift)), e.const(I8, 32, 3))
            levels.append(b.or_(low, b.shl(two_bits, e.const(I8, 32, 4))))
    d, packed = e.half(block, 208), e.load(block, 192, I8, 16)
    scales = b.fmul(e.splat(d, 16), b.sitofp(packed, vec(FLOAT, 16)))
    return Block(levels, scales, bias=32, per16=True,
                  d=d, int_scales=b.sext(packed, vec(I16, 16)), pairs_per_scale=8,
                  offsets16=b.fmul(scales, e.splat(ir.Constant(FLOAT, -32.0), 16)), int_total=e.int_totals)


def _unpack_q8_0(e, block):
    """Q8_0 (34 bytes): d (f16), 32 int8 levels."""
    return Block([e.load(block, 2, I8, 32)], e.splat(e.half(block, 0), 1), signed=True)


def _q5_levels(e, block, qh_offset):
    """The 32 levels (0..31) of a Q5_0 / Q5_1 block: fifth bits (a uint32) at `qh_offset`,
    then 16 bytes of nibbles (low: weights 0-15, high: weights 16-31)."""
    b = e.b
    low, high = e.nibbles(e.load(block, qh_offset + 4, I8, 16))
    fifth = b.zext(b.bitcast(e.load(block, qh_offset, I32), vec(I1, 32)), vec(I8, 32))
    return b.or_(e.shuffle(low, high, range(32)), b.shl(fifth, e.const(I8, 32, 4)))


def _unpack_q5_0(e, block):
    """Q5_0 (22 bytes): d (f16), fifth bits, nibbles. Levels 0..31 stand for -16..15."""
    return Block([_q5_levels(e, block, 2)], e.splat(e.half(block, 0), 1), bias=16)


def _unpack_q5_1(e, block):
    """Q5_1 (24 bytes): d, m (f16), fifth bits, nibbles; weight = d * level + m."""
    return Block([_q5_levels(e, block, 4)], e.splat(e.half(block, 0), 1),
                  offsets=e.splat(e.half(block, 2), 1))


def _q4_levels(e, block, offset):
    """The 32 levels (0..15) of a Q4_0 / Q4_1 block: 16 bytes of nibbles at `offset` (low:
    weights 0-15, high: weights 16-31)."""
    low, high = e.nibbles(e.load(block, offset, I8, 16))
    return e.shuffle(low, high, range(32))


def _unpack_q4_0(e, block):
    """Q4_0 (18 bytes): d (f16), nibbles. Levels 0..15 stand for -8..7."""
    return Block([_q4_levels(e, block, 2)], e.splat(e.half(block, 0), 1), bias=8)


def _unpack_q4_1(e, block):
    """Q4_1 (20 bytes): d, m (f16), nibbles; weight = d * level + m."""
    return Block([_q4_levels(e, block, 4)], e.splat(e.half(block, 0), 1), offsets=e.splat(e.half(block, 2), 1))


def _two_bit_levels(e, block, qs_offset):
    """The 2-bit parts of the 8 sub-blocks of a Q2_K / Q3_K block: sub-block 4h + j is bits
    2j..2j+1 of the 32 bytes at qs_offset + 32h (weights 0-15 from bytes 0-15, 16-31 from 16-31)."""
    b = e.b
    levels = []
    for h in range(2):
        packed = e.load(block, qs_offset + 32 * h, I8, 32)
        for j in range(4):
            levels.append(b.and_(b.lshr(packed, e.const(I8, 32, 2 * j)), e.const(I8, 32, 3)))
    return levels


def _unpack_q2_k(e, block):
    """Q2_K (84 bytes): 16 bytes of 4-bit scale | 4-bit min per 16 weights, 64 bytes of 2-bit
    levels, d, dmin (f16); weight = d * scale * level - dmin * min."""
    b = e.b
    packed = e.load(block, 0, I8, 16)
    scale4, min4 = e.nibbles(packed)
    d, dmin = e.half(block, 80), e.half(block, 82)
    scales = b.fmul(e.splat(d, 16), b.uitofp(scale4, vec(FLOAT, 16)))
    offsets = b.fneg(b.fmul(e.splat(dmin, 16), b.uitofp(min4, vec(FLOAT, 16))))
    return Block(_two_bit_levels(e, block, 16), scales, offsets=offsets, per16=True,
                  d=d, int_scales=b.zext(scale4, vec(I16, 16)), pairs_per_scale=8, offsets16=offsets)


def _q3_k_scales(e, block, offset):
    """IR: the 16 signed 6-bit scales of a Q3_K block (-32..31) as a <16 x i8>, unpacked from
    the 12 bytes at `offset` as ggml does (low 4 bits in bytes 0-7, top 2 bits in bytes 8-11)."""
    b = e.b
    a0, a1, top = (e.load(block, offset + 4 * i, I32) for i in range(3))
    low4, two = ir.Constant(I32, 0x0F0F0F0F), ir.Constant(I32, 0x03030303)

    def high(shift):
        return b.shl(b.and_(b.lshr(top, ir.Constant(I32, shift)), two), ir.Constant(I32, 4))

    def low(word, shift):
        return b.and_(b.lshr(word, ir.Constant(I32, shift)) if shift else word, low4)

    words = (b.or_(low(a0, 0), high(0)), b.or_(low(a1, 0), high(2)), b.or_(low(a0, 4), high(4)),
             b.or_(low(a1, 4), high(6)))
    packed = ir.Constant(vec(I32, 4), None)
    for i, word in enumerate(words):
        packed = b.insert_element(packed, word, ir.Constant(I32, i))
    return b.sub(b.bitcast(packed, vec(I8, 16)), e.const(I8, 16, 32))


def _unpack_q3_k(e, block):
    """Q3_K (110 bytes): 32 bytes of high bits (bit s of byte l for sub-block s), 64 bytes of
    2-bit levels, 12 bytes of packed 6-bit scales (one per 16 weights), d (f16). Levels 0..7
    (2 bits, plus 4 when the high bit is set) stand for -4..3."""
    b = e.b
    high = e.load(block, 0, I8, 32)
    levels = [b.or_(low, b.shl(b.and_(b.lshr(high, e.const(I8, 32, s)), e.const(I8, 32, 1)), e.const(I8, 32, 2)))
              for s, low in enumerate(_two_bit_levels(e, block, 32))]
    packed, d = _q3_k_scales(e, block, 96), e.half(block, 108)
    scales = b.fmul(e.splat(d, 16), b.sitofp(packed, vec(FLOAT, 16)))
    return Block(levels, scales, bias=4, per16=True,
                  d=d, int_scales=b.sext(packed, vec(I16, 16)), pairs_per_scale=8,
                  offsets16=b.fmul(scales, e.splat(ir.Constant(FLOAT, -4.0), 16)))


def _unpack_iq4_nl(e, block):
    """IQ4_NL (18 bytes): d (f16), nibbles as Q4_0's, each an index into IQ4_VALUES."""
    return Block([e.lookup16(IQ4_VALUES, _q4_levels(e, block, 2))], e.splat(e.half(block, 0), 1), signed=True)


def _unpack_mxfp4(e, block):
    """MXFP4 (17 bytes): an E8M0 exponent byte, nibbles as Q4_0's, each an index into
    MXFP4_VALUES (twice the E2M1 values); weight = value * 2**(e - 128)."""
    scale = e.e8m0_half(e.load(block, 0, I8))
    return Block([e.lookup16(MXFP4_VALUES, _q4_levels(e, block, 1))], e.splat(scale, 1), signed=True)


def _unpack_iq4_xs(e, block):
    """IQ4_XS (136 bytes): d (f16); scales_h (u16, 2 high bits of sub-block i's 6-bit scale at
    bit 2i); scales_l (4 bytes, low 4 bits: sub-block 2k low nibble, 2k + 1 high); 8 sub-blocks
    of IQ4_NL nibbles. Weight = d * (scale - 32) * IQ4_VALUES[nibble]."""
    b = e.b
    low = b.zext(e.pick(e.load(block, 4, I8, 4), [i // 2 for i in range(8)]), vec(I16, 8))
    low = b.and_(b.lshr(low, ir.Constant(vec(I16, 8), [ir.Constant(I16, 4 * (i % 2)) for i in range(8)])),
                 e.const(I16, 8, 0x0F))
    high = b.lshr(e.splat(e.load(block, 2, I16), 8), ir.Constant(vec(I16, 8), [ir.Constant(I16, 2 * i) for i in range(8)]))
    high = b.shl(b.and_(high, e.const(I16, 8, 3)), e.const(I16, 8, 4))
    int_scales = b.sub(b.or_(low, high), e.const(I16, 8, 32))
    d = e.half(block, 0)
    levels = [e.lookup16(IQ4_VALUES, _q4_levels(e, block, 8 + 16 * i)) for i in range(8)]
    return Block(levels, b.fmul(e.splat(d, 8), b.sitofp(int_scales, vec(FLOAT, 8))), signed=True,
                  d=d, int_scales=int_scales, pairs_per_scale=16, signs=levels)  # no IQ4 value is zero


def _ternary_block(e, levels, d):
    """A TQ1_0 / TQ2_0 block: levels 0..2 stand for -1..1, times d."""
    return Block(levels, e.splat(d, 8), bias=1, d=d, int_scales=e.const(I16, 8, 1), pairs_per_scale=16,
                  offsets16=e.b.fneg(e.splat(d, 16)))


def _unpack_tq2_0(e, block):
    """TQ2_0 (66 bytes): 64 bytes of 2-bit levels as Q2_K's, d (f16)."""
    return _ternary_block(e, _two_bit_levels(e, block, 0), e.half(block, 64))


def _trits(e, packed, n):
    """Trit n (0 the most significant) of each byte of a TQ1_0 run: ((byte * 3**n mod 256) * 3) >> 8."""
    b, count = e.b, packed.type.count
    shifted = b.zext(b.mul(packed, e.const(I8, count, 3**n % 256)), vec(I16, count))
    return b.trunc(b.lshr(b.mul(shifted, e.const(I16, count, 3)), e.const(I16, count, 8)), vec(I8, count))


def _unpack_tq1_0(e, block):
    """TQ1_0 (54 bytes): 48 bytes of 5 trits (bytes 0-31: weights 32n + m; bytes 32-47:
    160 + 16n + m), 4 bytes of 4 trits (240 + 4n + m), d (f16) last."""
    first = e.load(block, 0, I8, 32)
    second, last = e.load(block, 32, I8, 16), e.load(block, 48, I8, 4)
    levels = [_trits(e, first, n) for n in range(5)]
    halves = [_trits(e, second, n) for n in range(5)]
    quarters = [_trits(e, last, n) for n in range(4)]
    eight = e.shuffle(e.shuffle(quarters[0], quarters[1], range(8)), e.shuffle(quarters[2], quarters[3], range(8)), range(16))
    for pair in ((halves[0], halves[1]), (halves[2], halves[3]), (halves[4], eight)):
        levels.append(e.shuffle(*pair, range(32)))
    return _ternary_block(e, levels, e.half(block, 52))


UNPACKERS = {"Q4_K": _unpack_q4_k, "Q5_K": _unpack_q5_k, "Q6_K": _unpack_q6_k,
             "Q8_0": _unpack_q8_0, "Q5_0": _unpack_q5_0, "Q5_1": _unpack_q5_1,
             "Q4_0": _unpack_q4_0, "Q4_1": _unpack_q4_1, "Q2_K": _unpack_q2_k, "Q3_K": _unpack_q3_k,
             "IQ4_NL": _unpack_iq4_nl, "IQ4_XS": _unpack_iq4_xs, "MXFP4": _unpack_mxfp4,
             "TQ1_0": _unpack_tq1_0, "TQ2_0": _unpack_tq2_0, **GRID_UNPACKERS}
assert set(UNPACKERS) == set(FAST_ENCODINGS)


def quantized_encoding(tag):
    """The encoding named by a block tag's numba type when it is a quantized one, else None."""
    encoding = encoding_of(tag)
    return encoding if encoding in UNPACKERS else None


def _pair_sums(e, sums):
    """Sums of neighbouring lanes: per-16 sums -> per-32 sums."""
    n = sums.type.count
    return e.b.fadd(e.pick(sums, range(0, n, 2)), e.pick(sums, range(1, n, 2)))


def int8_dot(e, block, xq, xd, xs, xb, total):
    """IR: `total` (<8 x float>) plus lanes that sum to the dot of an unpacked block with
    the Q8_0 activation at xq (levels), xd (scales per 32) and xs (scaled sums per 16)."""
    b = e.b
    act_scales = e.load(xd, 0, FLOAT, len(block.levels))
    if not block.per16:
        scales = b.fmul(block.scales, act_scales)
    terms = []
    for j, level in enumerate(block.levels):
        x = e.load(xq, 32 * j, I8, 32)
        products = e.to_float(e.dot_s8s8(level, x) if block.signed else e.dot_u8s8(level, x))
        if block.per16:  # lanes 0-3 hold the first 16 weights, lanes 4-7 the next 16
            lanes = b.fmul(e.pick(block.scales, [2 * j] * 4 + [2 * j + 1] * 4), e.pick(act_scales, [j] * 8))
        else:
            lanes = e.pick(scales, [j] * 8)
        terms.append((products, lanes))
    total = b.fadd(total, e.weighted_sum(terms))
    sums16 = e.load(xs, 0, FLOAT, 2 * len(block.levels))
    sums = sums16 if block.per16 else _pair_sums(e, sums16)
    if block.bias:  # the levels were used without their bias: take bias * scale * sum off
        minus_bias = e.splat(ir.Constant(FLOAT, -block.bias), sums.type.count)
        total = b.fadd(total, e.fold8(b.fmul(b.fmul(block.scales, sums), minus_bias)))
    if block.offsets is not None:
        total = b.fadd(total, e.fold8(b.fmul(block.offsets, sums)))
    return total


def k_int8_dot(e, block, xq, xd, xs, xb, total):
    """IR: `total` (<8 x float>, <16 x float> with AVX-512) plus lanes that sum to the dot of
    an unpacked K-quant block with a Q8_K activation block: 256 int8 levels at xq, one
    float32 scale at xd, the sums of each 16 levels scaled at xs and as they are at xb. A block
    with `int_total` takes and returns its total as a float32 scalar."""
    return k_int8_dots(e, block, [(xq, xd, xs, xb)], [total])[0]


# The float operations of a block multiplied as one integer carry a flag (one that changes
# nothing for them), so that numba's fastmath pass, which flags only unflagged operations,
# leaves them in their order in every kernel.
KEEP_ORDER = ("arcp",)


def block_total(e, d, dmin, isum, imin, xd):
    """IR: the float32 of a block multiplied as one integer (`Block.int_total`), for the
    block's d and dmin (None: no mins), i32 scalars or vectors isum and imin and the
    activation scales xd: float(isum) * (d * xd) - float(imin) * (dmin * xd)."""
    b = e.b
    kind = xd.type

    def times(value, scale):
        scale = e.splat(scale, kind.count) if isinstance(kind, ir.VectorType) else scale
        return b.fmul(b.sitofp(value, kind), b.fmul(scale, xd, flags=KEEP_ORDER), flags=KEEP_ORDER)

    value = times(isum, d)
    return value if dmin is None else b.fsub(value, times(imin, dmin), flags=KEEP_ORDER)


def _integer_totals(e, block, accs, activations, totals):
    """k_int8_dots' end for a block multiplied as one integer: each acc less the bias's
    products (isum) and the mins' products (imin) summed side by side in 256-bit vectors,
    the block's float added to its total (a float32 scalar)."""
    b = e.b
    zero8, lane0 = e.const(I32, 8, 0), ir.Constant(I32, 0)
    results = []
    for acc, (_, xd, _, xb), total in zip(accs, activations, totals):
        sums16 = e.load(xb, 0, I16, 16)
        acc8 = b.add(e.pick(acc, range(8)), e.pick(acc, range(8, 16))) if acc.type.count == 16 else acc
        if block.bias:  # the levels were used without their bias: take bias * scale * sum off
            acc8 = e.add_pair_products(acc8, b.mul(block.int_scales, e.const(I16, 16, -block.bias)), sums16)
        mins = e.add_pair_products(zero8, block.int_mins16, sums16) if block.dmin is not None else zero8
        # [acc8 | mins] interleaved and summed down to <2 x i32>: isum, imin
        pairs = b.add(e.shuffle(acc8, mins, [0, 8, 1, 9, 4, 12, 5, 13]),
                      e.shuffle(acc8, mins, [2, 10, 3, 11, 6, 14, 7, 15]))
        pairs = b.add(pairs, e.pick(pairs, [2, 3, 0, 1, 6, 7, 4, 5]))
        pairs = b.add(e.pick(pairs, [0, 1]), e.pick(pairs, [4, 5]))
        xd1 = e.load(xd, 0, FLOAT)
        if block.dmin is None:
            value = block_total(e, block.d, None, b.extract_element(pairs, lane0), None, xd1)
        else:  # block_total's products for both at once
            scales = b.insert_element(b.insert_element(ir.Constant(vec(FLOAT, 2), None), block.d, lane0),
                                      block.dmin, ir.Constant(I32, 1))
            products = b.fmul(e.to_float(pairs), b.fmul(scales, e.splat(xd1, 2), flags=KEEP_ORDER), flags=KEEP_ORDER)
            value = b.fsub(b.extract_element(products, lane0), b.extract_element(products, ir.Constant(I32, 1)),
                           flags=KEEP_ORDER)
        results.append(b.fadd(total, value, flags=KEEP_ORDER))
    return results


def k_int8_dots(e, block, activations, totals):
    """IR: k_int8_dot of one unpacked K-quant block with each of the (xq, xd, xs, xb)
    `activations`, added to its `totals`. Sub-block products stay integer to the end of the block; with
    AVX-512 two sub-blocks are multiplied at a time. Each sub-block's levels and scales are
    multiplied by every activation before the next sub-block's are taken. With AVX2's 16
    vector registers that order is pinned (`Emitter.pinned`): left free, LLVM's scheduler
    takes the activations one at a time and spills the levels and scales of the whole block."""
    b, width = e.b, e.multiply_bytes
    per, lanes = width // 32, width // 4  # sub-blocks per multiply, int32 lanes of the sum
    accs = [e.const(I32, lanes, 0) for _ in activations]

    def taken(vectors, c):  # sub-blocks c*per.. of `vectors`, one multiply's width
        return vectors[per * c] if per == 1 else e.shuffle(vectors[per * c], vectors[per * c + 1], range(64))

    for c in range(len(block.levels) // per):
        scales = e.spread_words(block.int_scales, [(c * width // 2 + m) // block.pairs_per_scale
                                                   for m in range(width // 2)])
        # vpmaddubsw takes unsigned weights: their signs move to the activations
        if block.signs is not None:
            signs = taken(block.signs, c)
            weights = taken(block.magnitudes, c) if block.magnitudes else e.abs_bytes(signs)
        else:
            signs = taken(block.levels, c)
            weights = e.abs_bytes(signs) if block.signed else signs
        for k, (xq, _, _, _) in enumerate(activations):
            x = e.load(xq, width * c, I8, width)
            if block.signs is not None:
                x = e.signed_by(x, signs)
            elif block.signed:
                x = e.signed_like(x, signs)
            accs[k] = e.add_pair_products(accs[k], e.pair_products(weights, x), scales)
        if e.avx2 and not e.avx512 and len(accs) > 1:
            accs = e.pinned(accs)
    if block.int_total:
        return _integer_totals(e, block, accs, activations, totals)
    d = e.splat(block.d, lanes)
    results = []
    for acc, (_, xd, xs, _), total in zip(accs, activations, totals):
        sums = e.load(xs, 0, FLOAT, 16)
        if block.offsets16 is None:
            pass
        elif lanes == 8:
            total = e.fma(e.pick(block.offsets16, range(8)), e.pick(sums, range(8)), total)
            total = e.fma(e.pick(block.offsets16, range(8, 16)), e.pick(sums, range(8, 16)), total)
        else:
            total = e.fma(block.offsets16, sums, total)
        # (acc * d) * xd rather than acc * (d * xd): a vector multiply by the block's d, which
        # all activations share, and xd broadcast from memory into the FMA
        results.append(e.fma(b.fmul(e.to_float(acc), d, flags=CONTRACT), e.splat(e.load(xd, 0, FLOAT), lanes), total))
    return results


def dequantized_sub_block(e, block, j):
    """IR: the 32 float32 weights of sub-block j, exactly as ggml computes them."""
    b = e.b
    wide = (b.sext if block.signed else b.zext)(block.levels[j], vec(I32, 32))
    if block.bias:
        wide = b.sub(wide, e.const(I32, 32, block.bias))
    lanes = [2 * j] * 16 + [2 * j + 1] * 16 if block.per16 else [j] * 32
    values = b.fmul(e.pick(block.scales, lanes), b.sitofp(wide, vec(FLOAT, 32)))
    return values if block.offsets is None else b.fadd(values, e.pick(block.offsets, lanes))


def block_loop(e, encoding, start, count, body):
    """IR loop over `count` blocks of `encoding` from i8* `start`, prefetching ahead:
    body(index, unpacked block)."""
    weights, nbytes = block_size(encoding)
    with cgutils.for_range(e.b, count) as loop:
        block = e.at(start, e.b.mul(loop.index, ir.Constant(I64, nbytes)))
        for line in range(0, nbytes, CACHE_LINE):
            e.prefetch(e.at(block, PREFETCH_BYTES + line))
        body(loop.index, UNPACKERS[encoding](e, block))
