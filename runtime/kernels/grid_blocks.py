"""The IQ1/IQ2/IQ3 block types in LLVM IR: unpackers that look their weights up in ggml's grids.

A block of 256 weights names, per 8 (or 4) weights, an entry of its type's grid
(`formats.iq_grids`), and per 8 weights their signs; each entry is loaded from a constant
table in the module, as ggml's own kernels do. For IQ1_S, IQ1_M, IQ2_XXS and IQ3_XXS, with
AVX-512 (byte permutes, 16-bit variable shifts, byte popcounts) the indices, signs and scales of
a whole block are taken apart in vectors: signs given as KSIGNS indices become KSIGNS bytes by
adding each index's parity (as ggml's AVX2 kernels do), and an index made of several fields is
read back lane by lane (`Emitter.lanes`); with AVX2 or less, which lack those, scalar code takes
each field and the KSIGNS signs come from a table of 8 bytes of ±1 per index (ggml's
keven_signs). IQ2_XS, IQ2_S and IQ3_S have one way for every target: indices a field at a time,
signs in vectors (IQ2_XS's from its words a 128-bit lane at a time, the parity by a nibble
lookup), each sub-block's values emitted where the dot uses them (`PerSubBlock`: unpacked
whole, their blocks did not fit AVX2's 16 registers). Each choice measured faster on its
targets than the other (`bench/kernel_speed.py`). An unpacker returns the 8
sub-blocks of 32 as int8 grid values and ±1 signs, with their float scales, and the integer
form for the dot with Q8_K activations (`blocks.k_int8_dot`): odd integer scales and a
power-of-two `d`.
IQ1_S and IQ1_M add ±1/8 to each grid value; their levels are 8 (value ± 1/8), their scales a
1/8 of ggml's, which gives the same float32 weights. The levels come from one table of both
signs of the delta (`_IQ1_LEVELS`): the delta's sign bit is bit 11 of the index.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from colibri.formats.iq_grids import KSIGNS, grid
from colibri.runtime.kernels.emitter import FLOAT, I8, I16, I32, I64, vec
from colibri.runtime.kernels.unpacked import Block, PerSubBlock

_BIT_MASKS = [1 << j for j in range(8)] * 4  # weight j of a group of 8 has sign bit j
# IQ1 index i (11 bits) | minus << 11 -> the 8 levels 8 * (grid value + delta), delta = -1/8 if minus else +1/8
_IQ1_LEVELS = np.concatenate([8 * grid("IQ1_S") + 1, 8 * grid("IQ1_S") - 1]).astype(np.int8).tobytes()
_NIBBLE_PARITY = [0x80 * (bin(i).count("1") % 2) for i in range(16)]  # bit 7 set for a nibble of odd parity
# KSIGNS index i -> the signs of its 8 weights as bytes: -1 where bit j of KSIGNS[i] is set, else 1 (ggml's keven_signs)
_KSIGN_BYTES = np.where((KSIGNS[:, None] >> np.arange(8)) & 1, -1, 1).astype(np.int8).tobytes()


def _table(e, encoding):
    return e.table(f"colibri_grid_{encoding.lower()}", grid(encoding).tobytes())


def _u(e, value, element=I32):
    """An unsigned IR integer widened (or narrowed) to `element`."""
    if value.type.width == element.width:
        return value
    return e.b.zext(value, element) if value.type.width < element.width else e.b.trunc(value, element)


def _c(value, element=I32):
    return ir.Constant(element, value)


def _bit_signs(e, sign_bytes, first=0, step=1):
    """The ±1 signs (<32 x i8>) of 4 groups of 8 weights: -1 where bit j of sign_bytes[first
    + step * g] (a byte vector) is set, for weight j of group g."""
    b = e.b
    spread = e.pick(sign_bytes, [first + step * g for g in range(4) for _ in range(8)])
    negative = b.icmp_unsigned("!=", b.and_(spread, _lanes(I8, _BIT_MASKS)), e.const(I8, 32, 0))
    return b.select(negative, e.const(I8, 32, -1), e.const(I8, 32, 1))


def _ksigns_of(e, indices):
    """KSIGNS[i] of 7-bit indices (a byte vector): i with its parity in bit 7, as ggml's
    AVX2 kernels compute it."""
    b, n = e.b, indices.type.count
    parity = b.and_(e.call(f"llvm.ctpop.v{n}i8", indices.type, indices), e.const(I8, n, 1))
    return b.or_(indices, b.shl(parity, e.const(I8, n, 7)))


def _grid_block(e, d, int_scales, scale_unit, per16=False, *, magnitudes=None, signs=None, levels=None):
    """A block whose weights are d * scale_unit * int_scales * level: float scales as ggml
    computes them (d times the odd integer, then the power of two), d * scale_unit for the dot.
    The levels come as grid `magnitudes` and their ±1 `signs`, or (IQ1) as `levels` never zero."""
    b, n = e.b, int_scales.type.count
    odd = b.sitofp(int_scales, vec(FLOAT, n))
    scales = b.fmul(b.fmul(e.splat(d, n), odd), e.splat(ir.Constant(FLOAT, scale_unit), n))
    if levels is None:
        levels = PerSubBlock(len(magnitudes), lambda j: e.signed_by(magnitudes[j], signs[j]))
    return Block(levels, scales, signed=True, per16=per16, d=b.fmul(d, ir.Constant(FLOAT, scale_unit)),
                 int_scales=int_scales, pairs_per_scale=8 if per16 else 16,
                 signs=signs if signs is not None else levels, magnitudes=magnitudes)


def _half_odd(e, four_bits):
    """2 s + 1 of 4-bit scales s (an IR integer or integer vector; the IQ2/IQ3_XXS scales, 0.5 + s halved)."""
    kind = four_bits.type
    one = e.const(kind.element, kind.count, 1) if isinstance(kind, ir.VectorType) else _c(1, kind)
    return e.b.add(e.b.shl(four_bits, one), one)


def _lanes(element, values):
    """A constant vector of `values`."""
    return ir.Constant(vec(element, len(values)), [ir.Constant(element, v) for v in values])


def _bits(e, words, shifts, mask, element=None):
    """(words >> shifts) & mask, lane by lane (`shifts` a list as long as `words`), narrowed to
    `element` when given."""
    kind = words.type
    bits = e.b.and_(e.b.lshr(words, _lanes(kind.element, shifts)), e.const(kind.element, kind.count, mask))
    return bits if element is None else e.b.trunc(bits, vec(element, kind.count))


def _nibble_scales(e, block, offset, count):
    """2 s + 1 of the 2 * count 4-bit scales s in the `count` bytes at `offset`, each byte's
    low nibble first (<2 count x i16>)."""
    low, high = e.nibbles(e.load(block, offset, I8, count))
    both = e.shuffle(low, high, [k // 2 + (count if k % 2 else 0) for k in range(2 * count)])
    return _half_odd(e, e.b.zext(both, vec(I16, 2 * count)))


def _ksign_aux(e, aux):
    """The KSIGNS bytes of the 32 groups (<32 x i8>) and 2 s + 1 per sub-block (<8 x i16>) of
    the 8 sub-blocks' u32 words (<8 x i32>): 4 x 7 sign bits (KSIGNS indices), the 4-bit s on top."""
    indices = _bits(e, e.pick(aux, [ib for ib in range(8) for _ in range(4)]), [7 * l for _ in range(8) for l in range(4)],
                    127, I8)
    return _ksigns_of(e, indices), _half_odd(e, e.b.trunc(e.b.lshr(aux, e.const(I32, 8, 28)), vec(I16, 8)))


def _gathered(e, table, indices, width):
    """The 8 sub-blocks' grid values: the entries `width` bytes wide of `table` at `indices`
    (IR integers, 32 / width a sub-block)."""
    per = 32 // width
    return [e.gather(table, indices[per * ib:per * (ib + 1)], width) for ib in range(8)]


def _bytes_at(e, block, offset, count):
    """`count` bytes of the block from `offset`, as IR scalars (loaded one by one: an index
    that is a byte of the block is cheapest read from memory)."""
    return [e.load(block, offset + k, I8) for k in range(count)]


def _unpack_iq2_xxs(e, block):
    """IQ2_XXS (66 bytes): d (f16); per sub-block of 32, 4 grid indices (bytes, 8 weights
    each) and a u32 of 4 x 7 sign bits (KSIGNS indices) with the 4-bit scale s on top.
    Weight = d * (0.5 + s) / 4 * grid * sign."""
    sign_bytes, scales = _ksign_aux(e, e.pick(e.load(block, 2, I32, 16), range(1, 16, 2)))
    indices = [index for ib in range(8) for index in _bytes_at(e, block, 2 + 8 * ib, 4)]
    return _grid_block(e, e.half(block, 0), scales, 0.125, magnitudes=_gathered(e, _table(e, "IQ2_XXS"), indices, 8),
                       signs=[_bit_signs(e, sign_bytes, 4 * ib) for ib in range(8)])


def _unpack_iq3_xxs(e, block):
    """IQ3_XXS (98 bytes): d (f16), 64 grid indices (bytes, 4 weights each), then per
    sub-block a u32 of 4 x 7 sign bits (KSIGNS indices) and the 4-bit scale s on top.
    Weight = d * (0.5 + s) / 2 * grid * sign."""
    sign_bytes, scales = _ksign_aux(e, e.load(block, 66, I32, 8))
    return _grid_block(e, e.half(block, 0), scales, 0.25,
                       magnitudes=_gathered(e, _table(e, "IQ3_XXS"), _bytes_at(e, block, 2, 64), 4),
                       signs=[_bit_signs(e, sign_bytes, 4 * ib) for ib in range(8)])


def _iq1_levels(e, indices, minus=None):
    """8 * (grid value + delta) for 4 groups of 8, from their 12-bit indices (the delta's sign in
    bit 11), or from 11-bit ones and the sign of all four's delta (`minus`, an IR integer 0 or 1)."""
    table = e.table("colibri_iq1_levels", _IQ1_LEVELS)
    if minus is not None:
        table = e.at(table, e.b.shl(e.b.zext(minus, I64), ir.Constant(I64, 14)))  # the half of delta -1/8
    return e.gather(table, indices, 8)


def _unpack_iq1_s(e, block):
    """IQ1_S (50 bytes): d (f16), 32 low bytes of 11-bit grid indices (8 weights of -1, 0, 1
    each), per sub-block a u16: 3 high index bits per group, the 3-bit scale s at bit 12 and
    the delta's sign at bit 15. Weight = d * (2 s + 1) * (grid + delta), delta = ±1/8."""
    b = e.b
    qh = e.load(block, 34, I16, 8)
    spread = e.pick(qh, [k // 4 for k in range(32)])
    top = b.shl(_bits(e, spread, [3 * (k % 4) for k in range(32)], 7), e.const(I16, 32, 8))
    minus = b.and_(b.lshr(spread, e.const(I16, 32, 4)), e.const(I16, 32, 0x800))  # the delta's sign, bit 15 -> 11
    indices = e.lanes(b.or_(b.or_(b.zext(e.load(block, 2, I8, 32), vec(I16, 32)), top), minus))
    levels = [_iq1_levels(e, indices[4 * ib:4 * ib + 4]) for ib in range(8)]
    return _grid_block(e, e.half(block, 0), _half_odd(e, _bits(e, qh, [12] * 8, 7)), 0.125, levels=levels)


def _unpack_iq1_m(e, block):
    """IQ1_M (56 bytes): 32 low bytes of grid indices as IQ1_S's; 16 bytes, one per pair of
    groups: the 3 high bits of each index (bits 0-2, 4-6) and the sign of each one's delta (bits
    3, 7), so a nibble gives bits 8-11 of the `_IQ1_LEVELS` index; 4 u16 of 3-bit scales (4 per
    u16, one per 16 weights) whose top nibbles make the f16 d."""
    b = e.b
    d = _iq1_m_d(e, [_u(e, e.load(block, 48 + 2 * k, I16)) for k in range(4)])
    qh = e.load(block, 32, I8, 16)
    wide = b.zext(e.pick(qh, [k // 2 for k in range(32)]), vec(I16, 32))
    top = b.and_(b.shl(wide, _lanes(I16, [8 if k % 2 == 0 else 4 for k in range(32)])), e.const(I16, 32, 0xF00))
    indices = e.lanes(b.or_(b.zext(e.load(block, 0, I8, 32), vec(I16, 32)), top))
    levels = [_iq1_levels(e, indices[4 * ib:4 * ib + 4]) for ib in range(8)]
    scale_words = e.load(block, 48, I16, 4)
    scales = _half_odd(e, _bits(e, e.pick(scale_words, [k // 4 for k in range(16)]), [3 * (k % 4) for k in range(16)], 7))
    return _grid_block(e, d, scales, 0.125, per16=True, levels=levels)


def _iq1_m_d(e, words):
    """IQ1_M's f16 d, as float32, from the top nibbles of its 4 scale words (IR integers)."""
    b = e.b
    d_bits = b.or_(b.or_(b.lshr(words[0], _c(12)), b.and_(b.lshr(words[1], _c(8)), _c(0x00F0))),
                   b.or_(b.and_(b.lshr(words[2], _c(4)), _c(0x0F00)), b.and_(words[3], _c(0xF000))))
    return e.half_to_float(b.trunc(d_bits, I16))


def _ksigns_in_words(e, words):
    """The KSIGNS byte of each u16 word's top 7 bits (IQ2_XS), in the word's low byte (a byte
    vector twice as long): the index plus its parity, found as ggml's AVX2 kernel finds it,
    by a 16-entry lookup of the index folded to 4 bits (no byte popcount in AVX2)."""
    b, n = e.b, words.type.count
    indices = b.lshr(words, e.const(I16, n, 9))
    folded = b.and_(b.xor(indices, b.lshr(words, e.const(I16, n, 13))), e.const(I16, n, 0x0F))
    parity = e.lookup16(_NIBBLE_PARITY, b.bitcast(folded, vec(I8, 2 * n)))
    return b.or_(b.bitcast(indices, vec(I8, 2 * n)), parity)


def _ksign_bytes(e, indices):
    """The ±1 signs (<32 x i8>) of 4 groups of 8 weights from their KSIGNS indices (IR integers)."""
    return e.gather(e.table("colibri_ksign_bytes", _KSIGN_BYTES), indices, 8)


def _scalars(e, values):
    """A <n x i16> of IR integers."""
    v = ir.Constant(vec(I16, len(values)), None)
    for i, value in enumerate(values):
        v = e.b.insert_element(v, _u(e, value, I16), _c(i))
    return v


def _scalar_iq2_xxs(e, block):
    """IQ2_XXS as `_unpack_iq2_xxs`, a field at a time."""
    b = e.b
    magnitudes, signs, scales = [], [], []
    for ib in range(8):
        base = 2 + 8 * ib
        magnitudes.append(e.gather(_table(e, "IQ2_XXS"), _bytes_at(e, block, base, 4), 8))
        aux = e.load(block, base + 4, I32)
        signs.append(_ksign_bytes(e, [b.and_(b.lshr(aux, _c(7 * l)), _c(127)) for l in range(4)]))
        scales.append(_half_odd(e, b.lshr(aux, _c(28))))
    return _grid_block(e, e.half(block, 0), _scalars(e, scales), 0.125, magnitudes=magnitudes, signs=signs)


def _unpack_iq2_xs(e, block):
    """IQ2_XS (74 bytes): d (f16), 32 u16 (9-bit grid index, 7-bit KSIGNS index; 8 weights
    each), 8 bytes of two 4-bit scales per sub-block (one per 16 weights)."""
    b = e.b
    halves = [_ksigns_in_words(e, e.load(block, 2 + 32 * h, I16, 16)) for h in range(2)]

    def magnitude(ib):
        words = [_u(e, e.load(block, 2 + 2 * (4 * ib + l), I16)) for l in range(4)]
        return e.gather(_table(e, "IQ2_XS"), [b.and_(w, _c(511)) for w in words], 8)

    return _grid_block(e, e.half(block, 0), _nibble_scales(e, block, 66, 8), 0.125, per16=True,
                       magnitudes=PerSubBlock(8, magnitude),
                       signs=PerSubBlock(8, lambda ib: _bit_signs(e, halves[ib // 4], 8 * (ib % 4), 2)))


def _unpack_iq2_s(e, block):
    """IQ2_S (82 bytes): d (f16); 32 low bytes of 10-bit grid indices, then 32 sign bytes (8
    weights each); 8 bytes of the indices' top 2 bits (2 per group); scales as IQ2_XS."""
    b = e.b

    def magnitude(ib):
        high = _u(e, e.load(block, 66 + ib, I8))
        indices = [b.or_(_u(e, e.load(block, 2 + 4 * ib + l, I8)), b.and_(b.shl(high, _c(8 - 2 * l)), _c(0x300)))
                   for l in range(4)]
        return e.gather(_table(e, "IQ2_S"), indices, 8)

    return _grid_block(e, e.half(block, 0), _nibble_scales(e, block, 74, 8), 0.125, per16=True,
                       magnitudes=PerSubBlock(8, magnitude),
                       signs=PerSubBlock(8, lambda ib: _bit_signs(e, e.load(block, 34 + 4 * ib, I8, 4))))


def _scalar_iq3_xxs(e, block):
    """IQ3_XXS as `_unpack_iq3_xxs`, a field at a time."""
    b = e.b
    magnitudes, signs, scales = [], [], []
    for ib in range(8):
        magnitudes.append(e.gather(_table(e, "IQ3_XXS"), _bytes_at(e, block, 2 + 8 * ib, 8), 4))
        aux = e.load(block, 66 + 4 * ib, I32)
        signs.append(_ksign_bytes(e, [b.and_(b.lshr(aux, _c(7 * l)), _c(127)) for l in range(4)]))
        scales.append(_half_odd(e, b.lshr(aux, _c(28))))
    return _grid_block(e, e.half(block, 0), _scalars(e, scales), 0.25, magnitudes=magnitudes, signs=signs)


def _unpack_iq3_s(e, block):
    """IQ3_S (110 bytes): d (f16); 64 low bytes of 9-bit grid indices (4 weights each); 8
    bytes of their top bits (one per index); 32 sign bytes (8 weights each); 4 bytes of two
    4-bit scales s. Weight = d * (1 + 2 s) * grid * sign."""
    b = e.b

    def magnitude(ib):
        high = _u(e, e.load(block, 66 + ib, I8))
        indices = [b.or_(_u(e, e.load(block, 2 + 8 * ib + k, I8)), b.and_(b.shl(high, _c(8 - k)), _c(256)))
                   for k in range(8)]
        return e.gather(_table(e, "IQ3_S"), indices, 4)

    return _grid_block(e, e.half(block, 0), _nibble_scales(e, block, 106, 4), 1.0, magnitudes=PerSubBlock(8, magnitude),
                       signs=PerSubBlock(8, lambda ib: _bit_signs(e, e.load(block, 74 + 4 * ib, I8, 4))))


def _scalar_iq1_s(e, block):
    """IQ1_S as `_unpack_iq1_s`, a field at a time."""
    b = e.b
    levels, scales = [], []
    for ib in range(8):
        qh = _u(e, e.load(block, 34 + 2 * ib, I16))
        indices = [b.or_(_u(e, e.load(block, 2 + 4 * ib + l, I8)), b.shl(b.and_(b.lshr(qh, _c(3 * l)), _c(7)), _c(8)))
                   for l in range(4)]
        levels.append(_iq1_levels(e, indices, b.lshr(qh, _c(15))))
        scales.append(_half_odd(e, b.and_(b.lshr(qh, _c(12)), _c(7))))
    return _grid_block(e, e.half(block, 0), _scalars(e, scales), 0.125, levels=levels)


def _scalar_iq1_m(e, block):
    """IQ1_M as `_unpack_iq1_m`, a field at a time."""
    b = e.b
    words = [_u(e, e.load(block, 48 + 2 * k, I16)) for k in range(4)]
    levels, scales = [], []
    for ib in range(8):
        qh = [_u(e, e.load(block, 32 + 2 * ib + k, I8)) for k in range(2)]
        indices = [b.or_(_u(e, e.load(block, 4 * ib + l, I8)), b.and_(b.shl(qh[l // 2], _c(8 if l % 2 == 0 else 4)), _c(0xF00)))
                   for l in range(4)]
        levels.append(_iq1_levels(e, indices))
        word = words[ib // 2]
        scales += [_half_odd(e, b.and_(b.lshr(word, _c(6 * (ib % 2) + shift)), _c(7))) for shift in (0, 3)]
    return _grid_block(e, _iq1_m_d(e, words), _scalars(e, scales), 0.125, per16=True, levels=levels)


def _by_isa(vectors, scalars):
    """An unpacker that takes a block apart in vectors with AVX-512, a field at a time otherwise."""
    return lambda e, block: (vectors if e.avx512 else scalars)(e, block)


GRID_UNPACKERS = {"IQ2_XXS": _by_isa(_unpack_iq2_xxs, _scalar_iq2_xxs), "IQ2_XS": _unpack_iq2_xs,
                  "IQ2_S": _unpack_iq2_s, "IQ3_XXS": _by_isa(_unpack_iq3_xxs, _scalar_iq3_xxs), "IQ3_S": _unpack_iq3_s,
                  "IQ1_S": _by_isa(_unpack_iq1_s, _scalar_iq1_s), "IQ1_M": _by_isa(_unpack_iq1_m, _scalar_iq1_m)}
