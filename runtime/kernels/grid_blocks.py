"""The IQ1/IQ2/IQ3 block types in LLVM IR: unpackers that look their weights up in ggml's grids.

A block of 256 weights names, per 8 (or 4) weights, an entry of its type's grid
(`formats.iq_grids`), and per 8 weights their signs; each entry is loaded from a constant
table in the module, as ggml's own kernels do. An unpacker returns the 8 sub-blocks of 32 as
signed int8 levels (grid value times sign) with their float scales, and the integer form for
the dot with Q8_K activations (`blocks.k_int8_dot`): odd integer scales and a power-of-two `d`.
IQ1_S and IQ1_M add ±1/8 to each grid value; their levels are 8 (value ± 1/8), their scales a
1/8 of ggml's, which gives the same float32 weights.
"""

from __future__ import annotations

from llvmlite import ir

from colibri.formats.iq_grids import KSIGNS, grid
from colibri.runtime.kernels.emitter import FLOAT, I8, I16, I32, vec
from colibri.runtime.kernels.unpacked import Block

_BIT_MASKS = [1 << j for j in range(8)] * 4  # weight j of a group of 8 has sign bit j
# IQ1_M: the bit of its pair's qh byte that gives each weight's delta sign (group l: 3, or 7 for odd l)
_DELTA_BITS = ir.Constant(vec(I8, 32), [ir.Constant(I8, 0x08 if l % 2 == 0 else 0x80) for l in range(4) for _ in range(8)])


def _table(e, encoding):
    return e.table(f"colibri_grid_{encoding.lower()}", grid(encoding).tobytes())


def _ksigns(e):
    return e.table("colibri_ksigns_iq2xs", KSIGNS.tobytes())


def _vector(e, scalars, element):
    """A vector of IR scalars (each widened or narrowed to `element`, as `_u`)."""
    v = ir.Constant(vec(element, len(scalars)), None)
    for i, s in enumerate(scalars):
        v = e.b.insert_element(v, _u(e, s, element), ir.Constant(I32, i))
    return v


def _u(e, value, element=I32):
    """An unsigned IR integer widened (or narrowed) to `element`."""
    if value.type.width == element.width:
        return value
    return e.b.zext(value, element) if value.type.width < element.width else e.b.trunc(value, element)


def _c(value, element=I32):
    return ir.Constant(element, value)


def _signed(e, values, sign_bytes):
    """values (<32 x i8>) negated where bit j of sign_bytes[g] (<4 x i8>) is set, for weight j of group g."""
    b = e.b
    spread = e.pick(sign_bytes, [g for g in range(4) for _ in range(8)])
    masks = ir.Constant(vec(I8, 32), [ir.Constant(I8, m) for m in _BIT_MASKS])
    negative = b.icmp_unsigned("!=", b.and_(spread, masks), ir.Constant(vec(I8, 32), None))
    return b.select(negative, b.sub(ir.Constant(vec(I8, 32), None), values), values)


def _grid_block(e, levels, d, int_scales, scale_unit, per16=False):
    """A block whose weights are d * scale_unit * int_scales * level: float scales as ggml
    computes them (d times the odd integer, then the power of two), d * scale_unit for the dot."""
    b, n = e.b, int_scales.type.count
    odd = b.sitofp(int_scales, vec(FLOAT, n))
    scales = b.fmul(b.fmul(e.splat(d, n), odd), e.splat(ir.Constant(FLOAT, scale_unit), n))
    return Block(levels, scales, signed=True, per16=per16, d=b.fmul(d, ir.Constant(FLOAT, scale_unit)),
                 int_scales=int_scales, pairs_per_scale=8 if per16 else 16)


def _half_odd(e, four_bits):
    """2 s + 1 of a 4-bit scale s (the IQ2/IQ3_XXS scales, 0.5 + s halved)."""
    return e.b.add(e.b.shl(four_bits, _c(1, four_bits.type)), _c(1, four_bits.type))


def _unpack_iq2_xxs(e, block):
    """IQ2_XXS (66 bytes): d (f16); per sub-block of 32, 4 grid indices (bytes, 8 weights
    each) and a u32 of 4 x 7 sign bits (KSIGNS indices) with the 4-bit scale s on top.
    Weight = d * (0.5 + s) / 4 * grid * sign."""
    b, table, ksigns = e.b, _table(e, "IQ2_XXS"), _ksigns(e)
    levels, scales = [], []
    for ib in range(8):
        base = 2 + 8 * ib
        values = e.gather(table, [e.load(block, base + l, I8) for l in range(4)], 8)
        aux = e.load(block, base + 4, I32)
        signs = e.gather(ksigns, [b.and_(b.lshr(aux, _c(7 * l)), _c(127)) for l in range(4)], 1)
        levels.append(_signed(e, values, signs))
        scales.append(_half_odd(e, b.lshr(aux, _c(28))))
    return _grid_block(e, levels, e.half(block, 0), _vector(e, scales, I16), 0.125)


def _unpack_iq2_xs(e, block):
    """IQ2_XS (74 bytes): d (f16), 32 u16 (9-bit grid index, 7-bit KSIGNS index; 8 weights
    each), 8 bytes of two 4-bit scales per sub-block (one per 16 weights)."""
    b, table, ksigns = e.b, _table(e, "IQ2_XS"), _ksigns(e)
    levels, scales = [], []
    for ib in range(8):
        words = [_u(e, e.load(block, 2 + 2 * (4 * ib + l), I16)) for l in range(4)]
        values = e.gather(table, [b.and_(w, _c(511)) for w in words], 8)
        levels.append(_signed(e, values, e.gather(ksigns, [b.lshr(w, _c(9)) for w in words], 1)))
        packed = _u(e, e.load(block, 66 + ib, I8))
        scales += [_half_odd(e, b.and_(packed, _c(15))), _half_odd(e, b.lshr(packed, _c(4)))]
    return _grid_block(e, levels, e.half(block, 0), _vector(e, scales, I16), 0.125, per16=True)


def _unpack_iq2_s(e, block):
    """IQ2_S (82 bytes): d (f16); 32 low bytes of 10-bit grid indices, then 32 sign bytes (8
    weights each); 8 bytes of the indices' top 2 bits (2 per group); scales as IQ2_XS."""
    b, table = e.b, _table(e, "IQ2_S")
    levels, scales = [], []
    for ib in range(8):
        high = _u(e, e.load(block, 66 + ib, I8))
        indices = [b.or_(_u(e, e.load(block, 2 + 4 * ib + l, I8)), b.and_(b.shl(high, _c(8 - 2 * l)), _c(0x300)))
                   for l in range(4)]
        levels.append(_signed(e, e.gather(table, indices, 8), e.load(block, 34 + 4 * ib, I8, 4)))
        packed = _u(e, e.load(block, 74 + ib, I8))
        scales += [_half_odd(e, b.and_(packed, _c(15))), _half_odd(e, b.lshr(packed, _c(4)))]
    return _grid_block(e, levels, e.half(block, 0), _vector(e, scales, I16), 0.125, per16=True)


def _unpack_iq3_xxs(e, block):
    """IQ3_XXS (98 bytes): d (f16), 64 grid indices (bytes, 4 weights each), then per
    sub-block a u32 of 4 x 7 sign bits (KSIGNS indices) and the 4-bit scale s on top.
    Weight = d * (0.5 + s) / 2 * grid * sign."""
    b, table, ksigns = e.b, _table(e, "IQ3_XXS"), _ksigns(e)
    levels, scales = [], []
    for ib in range(8):
        values = e.gather(table, [e.load(block, 2 + 8 * ib + l, I8) for l in range(8)], 4)
        aux = e.load(block, 66 + 4 * ib, I32)
        signs = e.gather(ksigns, [b.and_(b.lshr(aux, _c(7 * l)), _c(127)) for l in range(4)], 1)
        levels.append(_signed(e, values, signs))
        scales.append(_half_odd(e, b.lshr(aux, _c(28))))
    return _grid_block(e, levels, e.half(block, 0), _vector(e, scales, I16), 0.25)


def _unpack_iq3_s(e, block):
    """IQ3_S (110 bytes): d (f16); 64 low bytes of 9-bit grid indices (4 weights each); 8
    bytes of their top bits (one per index); 32 sign bytes (8 weights each); 4 bytes of two
    4-bit scales s. Weight = d * (1 + 2 s) * grid * sign."""
    b, table = e.b, _table(e, "IQ3_S")
    levels, scales = [], []
    for ib in range(8):
        high = _u(e, e.load(block, 66 + ib, I8))
        indices = [b.or_(_u(e, e.load(block, 2 + 8 * ib + k, I8)), b.and_(b.shl(high, _c(8 - k)), _c(256)))
                   for k in range(8)]
        levels.append(_signed(e, e.gather(table, indices, 4), e.load(block, 74 + 4 * ib, I8, 4)))
        packed = _u(e, e.load(block, 106 + ib // 2, I8))
        scales.append(_half_odd(e, b.and_(b.lshr(packed, _c(4 * (ib % 2))), _c(15))))
    return _grid_block(e, levels, e.half(block, 0), _vector(e, scales, I16), 1.0)


def _iq1_levels(e, table, indices, deltas):
    """8 * (grid value + delta) for 4 groups of 8, `deltas` (<32 x i8>, a lane per weight) being
    8 * delta: -1 or +1."""
    return e.b.add(e.b.shl(e.gather(table, indices, 8), e.const(I8, 32, 3)), deltas)


def _unpack_iq1_s(e, block):
    """IQ1_S (50 bytes): d (f16), 32 low bytes of 11-bit grid indices (8 weights of -1, 0, 1
    each), per sub-block a u16: 3 high index bits per group, the 3-bit scale s at bit 12 and
    the delta's sign at bit 15. Weight = d * (2 s + 1) * (grid + delta), delta = ±1/8."""
    b, table = e.b, _table(e, "IQ1_S")
    levels, scales = [], []
    for ib in range(8):
        qh = _u(e, e.load(block, 34 + 2 * ib, I16))
        indices = [b.or_(_u(e, e.load(block, 2 + 4 * ib + l, I8)), b.shl(b.and_(b.lshr(qh, _c(3 * l)), _c(7)), _c(8)))
                   for l in range(4)]
        negative = b.icmp_unsigned("!=", b.and_(qh, _c(0x8000)), _c(0))
        levels.append(_iq1_levels(e, table, indices, e.splat(b.select(negative, _c(-1, I8), _c(1, I8)), 32)))
        scales.append(_half_odd(e, b.and_(b.lshr(qh, _c(12)), _c(7))))
    return _grid_block(e, levels, e.half(block, 0), _vector(e, scales, I16), 0.125)


def _unpack_iq1_m(e, block):
    """IQ1_M (56 bytes): 32 low bytes of grid indices as IQ1_S's; 16 bytes, one per pair of
    groups: the 3 high bits of each index (bits 0-2, 4-6) and the sign of each one's delta (bits
    3, 7); 4 u16 of 3-bit scales (4 per u16, one per 16 weights) whose top nibbles make the f16 d."""
    b, table = e.b, _table(e, "IQ1_M")
    words = [_u(e, e.load(block, 48 + 2 * k, I16)) for k in range(4)]
    d_bits = b.or_(b.or_(b.lshr(words[0], _c(12)), b.and_(b.lshr(words[1], _c(8)), _c(0x00F0))),
                   b.or_(b.and_(b.lshr(words[2], _c(4)), _c(0x0F00)), b.and_(words[3], _c(0xF000))))
    levels, scales = [], []
    for ib in range(8):
        qh = [_u(e, e.load(block, 32 + 2 * ib + k, I8)) for k in range(2)]
        indices = [b.or_(_u(e, e.load(block, 4 * ib + l, I8)), b.and_(b.shl(qh[l // 2], _c(8 if l % 2 == 0 else 4)), _c(0x700)))
                   for l in range(4)]
        # each weight's delta sign: bit 3 (even groups) or 7 (odd) of its pair's qh byte, all lanes at once
        spread = e.pick(e.load(block, 32 + 2 * ib, I8, 2), [l // 2 for l in range(4) for _ in range(8)])
        minus = b.icmp_unsigned("!=", b.and_(spread, _DELTA_BITS), e.const(I8, 32, 0))
        levels.append(_iq1_levels(e, table, indices, b.select(minus, e.const(I8, 32, -1), e.const(I8, 32, 1))))
        word = words[ib // 2]
        scales += [_half_odd(e, b.and_(b.lshr(word, _c(6 * (ib % 2) + shift)), _c(7))) for shift in (0, 3)]
    d = e.half_to_float(b.trunc(d_bits, I16))
    return _grid_block(e, levels, d, _vector(e, scales, I16), 0.125, per16=True)


GRID_UNPACKERS = {"IQ2_XXS": _unpack_iq2_xxs, "IQ2_XS": _unpack_iq2_xs, "IQ2_S": _unpack_iq2_s,
                  "IQ3_XXS": _unpack_iq3_xxs, "IQ3_S": _unpack_iq3_s, "IQ1_S": _unpack_iq1_s, "IQ1_M": _unpack_iq1_m}
