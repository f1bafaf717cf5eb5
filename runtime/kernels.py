"""Fused dequantize-and-multiply kernels for the colibri block encodings (numba).

A weight matrix is a flat uint8 array of `rows * row_bytes` bytes in one of the encodings of
`formats/encodings.py` (GGML blocks, see `formats/spec.md` §2). Every product has two paths,
chosen per call with `exact`:

- **fast** (`exact=False`, the default; Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q5_1): the activation
  is quantized to int8 in blocks of 32 values (a float32 scale per 32, like ggml's Q8_0
  activations, plus the scaled sum of each 16 values for the blocks' offsets and minimums),
  and each weight block is multiplied with integer dot products. The dot of a whole row is
  one `@intrinsic` that emits LLVM IR: `vpdpbusd` with AVX-VNNI, `vpmaddubsw` + `vpmaddwd`
  with AVX2, and portable vector IR on other CPUs. `matmul` unpacks each weight block once
  for GROUP rows of x. Error: see `FAST_PATH_TOLERANCE`.
- **exact** (`exact=True`, and always for F32, F16 and BF16): each weight is dequantized to
  the float32 that `gguf.quants.dequantize` gives (bit for bit) and multiplied with the
  float32 activation. `matmul` dequantizes each chunk of 256 weights once for all rows of x.

Each quantized block type is described once, as LLVM IR that unpacks a block (`_unpack_*`);
the int8 dot product, the exact dot product and the dequantizer are built from it.

An encoding reaches compiled code as a compile-time tag, the numpy dtype of one of its
blocks (`BLOCK_TAGS`), so numba compiles one specialization per encoding, and only for the
encodings a program uses. An activation is either a float32 array (exact path) or a tuple
`(q int8, d float32 per 32, sums float32 per 16)` (fast path); the kernels are generic over
both, and one quantized activation serves every matrix that multiplies it (gate and up, all
the experts of a layer).

Threads: each parallel kernel gives thread `t` one contiguous range of rows (one memory
stream per thread) and prefetches `PREFETCH_BYTES` ahead of the block it multiplies. Numba's
`workqueue` threading layer costs ~0.1 ms per parallel call; `set_threads` warns about it.
"""

from __future__ import annotations

import warnings

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from formats.encodings import ENCODINGS, block_size, row_bytes

F32 = np.float32
CHUNK = 256  # weights dequantized at a time by the exact path (a multiple of every block size)
ACT_BLOCK = 32  # activation values per int8 scale
GROUP = 8  # activations multiplied together by the int8 matmul (each weight block unpacked once);
# a remainder of at least GROUP // 2 rows is done as one half group
PREFETCH_BYTES = 4096  # how far ahead of the current block the weight stream is prefetched
CACHE_LINE = 64

# Error of the fast path relative to the output's max-abs, against float64 products of the
# same weights. Measured on random weights and gaussian activations: median 8e-3, worst
# 1.0e-2 in 40 cases per encoding (heavy-tailed activations with outliers: worst 2e-2).
# ggml's int8 activations cost the same.
FAST_PATH_TOLERANCE = 1.5e-2
FAST_ENCODINGS = ("Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_njit = njit(cache=True, nogil=True)
_parallel = njit(cache=True, nogil=True, parallel=True)


def _block_tag(encoding: str) -> np.dtype:
    """The dtype of one block of `encoding`: a record named after it."""
    return np.dtype([(encoding, np.uint8, (block_size(encoding)[1],))])


BLOCK_TAGS = {encoding: _block_tag(encoding) for encoding in ENCODINGS}


def _encoding_of(tag) -> str | None:
    """The encoding named by a block tag's numba type, or None for anything else."""
    if isinstance(tag, types.DType) and isinstance(tag.dtype, types.Record):
        name = next(iter(tag.dtype.fields))
        return name if name in BLOCK_TAGS else None
    return None


# ------------------------------------------------------------------ LLVM IR building blocks

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_F32, _HALF = ir.FloatType(), ir.HalfType()
_BYTE_PTR = _I8.as_pointer()
_FAST = ("contract",)  # lets LLVM fuse a multiply and an add into an FMA


def _vec(element, n):
    return ir.VectorType(element, n)


class _Emitter:
    """LLVM IR building blocks for the CPU numba compiles for: AVX-VNNI or AVX2 dot products
    and F16C conversions where the target has them, portable IR otherwise."""

    def __init__(self, context, builder):
        triple, _, features = context.codegen().magic_tuple()
        enabled = {f[1:] for f in features.split(",") if f.startswith("+")}
        x86 = triple.startswith(("x86_64", "i386", "i686"))
        self.context, self.b = context, builder
        self.avx2 = x86 and "avx2" in enabled
        self.vnni = self.avx2 and ("avxvnni" in enabled or {"avx512vnni", "avx512vl"} <= enabled)
        self.native_half = not x86 or "f16c" in enabled

    # memory
    def pointer(self, arraytype, array, byte_offset=None):
        """i8* to an array's data, `byte_offset` (an int64 IR value) bytes in."""
        data = self.context.make_array(arraytype)(self.context, self.b, array).data
        data = self.b.bitcast(data, _BYTE_PTR)
        return data if byte_offset is None else self.b.gep(data, [byte_offset])

    def at(self, base, offset):
        return self.b.gep(base, [offset if isinstance(offset, ir.Value) else ir.Constant(_I64, offset)])

    def load(self, base, offset, element, n=None):
        kind = element if n is None else _vec(element, n)
        return self.b.load(self.b.bitcast(self.at(base, offset), kind.as_pointer()), align=1)

    def prefetch(self, address):
        fn = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(ir.VoidType(), [_BYTE_PTR, _I32, _I32, _I32]), "llvm.prefetch.p0")
        self.b.call(fn, [address, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

    def half(self, base, offset):
        return self.half_to_float(self.load(base, offset, _I16))

    def half_to_float(self, bits):
        """float32 of IEEE half bits (an i16); exact for every finite half."""
        b = self.b
        if self.native_half:
            return b.fpext(b.bitcast(bits, _HALF), _F32)
        # Without F16C, LLVM would call a runtime function numba does not provide: move the
        # exponent and mantissa into float32 position and rescale the exponent by 2**112.
        wide = b.zext(bits, _I32)
        magnitude = b.bitcast(b.shl(b.and_(wide, ir.Constant(_I32, 0x7FFF)), ir.Constant(_I32, 13)), _F32)
        magnitude = b.bitcast(b.fmul(magnitude, ir.Constant(_F32, 2.0**112)), _I32)
        sign = b.shl(b.and_(wide, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16))
        return b.bitcast(b.or_(magnitude, sign), _F32)

    def call(self, name, result, *args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(result, [a.type for a in args]), name)
        return self.b.call(fn, args)

    # vectors
    @staticmethod
    def const(element, n, value):
        return ir.Constant(_vec(element, n), [ir.Constant(element, value)] * n)

    def shuffle(self, a, b, lanes):
        return self.b.shuffle_vector(a, b, ir.Constant(_vec(_I32, len(lanes)), list(lanes)))

    def pick(self, vector, lanes):
        return self.shuffle(vector, ir.Constant(vector.type, None), lanes)

    def splat(self, scalar, n=8):
        one = self.b.insert_element(ir.Constant(_vec(scalar.type, 1), None), scalar, ir.Constant(_I32, 0))
        return self.pick(one, [0] * n)

    def fma(self, a, b, c):
        return self.b.fadd(self.b.fmul(a, b, flags=_FAST), c, flags=_FAST)

    def weighted_sum(self, terms):
        """Sum of a * b over (a, b) vector pairs: a multiply and an FMA per two pairs, then a
        tree of adds, so that no long chain of dependent FMAs limits the loop."""
        sums = []
        for i in range(0, len(terms), 2):
            total = self.b.fmul(*terms[i], flags=_FAST)
            sums.append(self.fma(*terms[i + 1], total) if i + 1 < len(terms) else total)
        while len(sums) > 1:
            pairs = [sums[i:i + 2] for i in range(0, len(sums), 2)]
            sums = [self.b.fadd(*pair) if len(pair) == 2 else pair[0] for pair in pairs]
        return sums[0]

    def fold8(self, v):
        """A <8 x float> whose lanes sum to the sum of v's lanes (v: 1 to 8, or a multiple of 8)."""
        n = v.type.count
        if n > 8:
            return self.fold8(self.b.fadd(self.pick(v, range(n // 2)), self.pick(v, range(n // 2, n))))
        return v if n == 8 else self.shuffle(v, ir.Constant(v.type, [0.0] * n), [min(i, n) for i in range(8)])

    def to_float(self, ints):
        return self.b.sitofp(ints, _vec(_F32, ints.type.count))

    def hsum(self, v8):
        b = self.b
        v4 = b.fadd(self.pick(v8, range(4)), self.pick(v8, range(4, 8)))
        v2 = b.fadd(self.pick(v4, range(2)), self.pick(v4, range(2, 4)))
        return b.fadd(b.extract_element(v2, ir.Constant(_I32, 0)), b.extract_element(v2, ir.Constant(_I32, 1)))

    def _sum_quads(self, products):
        """<32 x i32> -> <8 x i32>, lane m = products[4m] + ... + products[4m + 3]."""
        sums = [self.pick(products, range(k, 32, 4)) for k in range(4)]
        return self.b.add(self.b.add(sums[0], sums[1]), self.b.add(sums[2], sums[3]))

    def dot_u8s8(self, unsigned, signed):
        """<8 x i32>, lane m = sum of unsigned[j] * signed[j] over bytes j = 4m..4m+3.
        Callers keep every pair sum within int16 (vpmaddubsw saturates)."""
        b = self.b
        if self.vnni:
            as_i32 = _vec(_I32, 8)
            return self.call("llvm.x86.avx512.vpdpbusd.256", as_i32, self.const(_I32, 8, 0),
                             b.bitcast(unsigned, as_i32), b.bitcast(signed, as_i32))
        if self.avx2:
            pairs = self.call("llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), unsigned, signed)
            return self.call("llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), pairs, self.const(_I16, 16, 1))
        wide = _vec(_I32, 32)
        return self._sum_quads(b.mul(b.zext(unsigned, wide), b.sext(signed, wide)))

    def dot_s8s8(self, left, right):
        """As dot_u8s8 for two signed vectors (|left| <= 128, |right| <= 127): |left| times
        right with left's sign."""
        if self.avx2:
            magnitude = self.call("llvm.abs.v32i8", left.type, left, ir.Constant(_I1, 0))
            return self.dot_u8s8(magnitude, self.call("llvm.x86.avx2.psign.b", left.type, right, left))
        wide = _vec(_I32, 32)
        return self._sum_quads(self.b.mul(self.b.sext(left, wide), self.b.sext(right, wide)))

    def nibbles(self, packed):
        """(low, high) 4-bit halves of a byte vector."""
        n = packed.type.count
        return self.b.and_(packed, self.const(_I8, n, 0x0F)), self.b.lshr(packed, self.const(_I8, n, 4))


# ------------------------------------------------------------------ scalar helpers (numba)


@intrinsic
def _half_to_float(typingctx, bits):
    """float32 of the IEEE half whose bits are the low 16 of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return _Emitter(context, builder).half_to_float(builder.trunc(args[0], _I16))

    return types.float32(bits), codegen


@intrinsic
def _bf16_to_float(typingctx, bits):
    """float32 of the bfloat16 whose bits are the low 16 of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        wide = builder.zext(builder.trunc(args[0], _I16), _I32)
        return builder.bitcast(builder.shl(wide, ir.Constant(_I32, 16)), _F32)

    return types.float32(bits), codegen


@intrinsic
def _prefetch(typingctx, array, byte_offset):
    """Prefetch the cache line of `array`'s byte `byte_offset` into all cache levels."""
    if not isinstance(array, types.Array) or not isinstance(byte_offset, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder)
        offset = context.cast(builder, args[1], signature.args[1], types.int64)
        e.prefetch(e.pointer(signature.args[0], args[0], offset))
        return context.get_dummy_value()

    return types.void(array, byte_offset), codegen


@_njit
def _prefetch_ahead(w, offset, nbytes):
    """Prefetch the `nbytes` that follow `offset` + PREFETCH_BYTES, a line at a time."""
    for line in range(0, nbytes, CACHE_LINE):
        _prefetch(w, offset + PREFETCH_BYTES + line)


@njit(cache=True, nogil=True, fastmath=True)
def _dot(a, b, n):
    """float32 dot of a[:n] and b[:n] (vectorized: fastmath lets the sum be reordered)."""
    total = F32(0.0)
    for i in range(n):
        total += a[i] * b[i]
    return total


# ------------------------------------------------------------------ block types


class _Block:
    """One block unpacked to IR values. Weight i of sub-block j (32 weights each) is
    `scale * (level - bias) + offset`: `levels[j]` a <32 x i8> (`signed` or not), `scales`
    one float per sub-block (or per 16 weights when `per16`), `offsets` one float per
    sub-block or None. The order of the float operations is ggml's (and gguf's)."""

    def __init__(self, levels, scales, signed=False, bias=0, offsets=None, per16=False):
        self.levels, self.scales, self.signed, self.bias = levels, scales, signed, bias
        self.offsets, self.per16 = offsets, per16


def _k_scales(e, block, offset):
    """IR: (scales, mins) of a Q4_K / Q5_K block as two <8 x float>, unpacked as ggml does
    from the 12 bytes at `offset` (6 bits each: sub-blocks 0-3 in the low bits of bytes
    0-7, sub-blocks 4-7 in bytes 8-11 and the top bits of bytes 0-7)."""
    b = e.b
    u0, u1, u2 = (e.load(block, offset + 4 * i, _I32) for i in range(3))
    low6, low4, top2 = (ir.Constant(_I32, m) for m in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))

    def tops(u):  # bits 6-7 of each byte, moved to bits 4-5
        return b.shl(b.and_(b.lshr(u, ir.Constant(_I32, 6)), top2), ir.Constant(_I32, 4))

    words = (b.and_(u0, low6), b.or_(b.and_(u2, low4), tops(u0)),
             b.and_(u1, low6), b.or_(b.and_(b.lshr(u2, ir.Constant(_I32, 4)), low4), tops(u1)))
    packed = ir.Constant(_vec(_I32, 4), None)
    for i, word in enumerate(words):
        packed = b.insert_element(packed, word, ir.Constant(_I32, i))
    values = b.uitofp(b.bitcast(packed, _vec(_I8, 16)), _vec(_F32, 16))
    return e.pick(values, range(8)), e.pick(values, range(8, 16))


def _unpack_q4_k(e, block):
    """Q4_K (144 bytes): d, dmin (f16); 12 bytes of 6-bit scales and mins; 128 bytes of
    nibbles, low nibbles of bytes 32g.. for sub-block 2g, high nibbles for 2g + 1."""
    scales, mins = _k_scales(e, block, 4)
    levels = [q for g in range(4) for q in e.nibbles(e.load(block, 16 + 32 * g, _I8, 32))]
    return _Block(levels, e.b.fmul(e.splat(e.half(block, 0)), scales),
                  offsets=e.b.fneg(e.b.fmul(e.splat(e.half(block, 2)), mins)))


def _unpack_q5_k(e, block):
    """Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits (bit j for sub-block j)
    between the scales and the nibbles."""
    b = e.b
    scales, mins = _k_scales(e, block, 4)
    high_bits = e.load(block, 16, _I8, 32)
    levels = []
    for g in range(4):
        for j, q in zip((2 * g, 2 * g + 1), e.nibbles(e.load(block, 48 + 32 * g, _I8, 32))):
            fifth = b.and_(b.lshr(high_bits, e.const(_I8, 32, j)), e.const(_I8, 32, 1))
            levels.append(b.or_(q, b.shl(fifth, e.const(_I8, 32, 4))))
    return _Block(levels, b.fmul(e.splat(e.half(block, 0)), scales),
                  offsets=b.fneg(b.fmul(e.splat(e.half(block, 2)), mins)))


def _unpack_q6_k(e, block):
    """Q6_K (210 bytes): 128 bytes of low nibbles (ql), 64 of 2-bit high parts (qh), 16 int8
    scales (one per 16 weights), d (f16) last. Levels 0..63 stand for -32..31."""
    b = e.b
    levels = []
    for h in range(2):  # 128 weights: sub-blocks from ql[0:32] low, ql[32:64] low, then high
        a_lo, a_hi = e.nibbles(e.load(block, 64 * h, _I8, 32))
        b_lo, b_hi = e.nibbles(e.load(block, 64 * h + 32, _I8, 32))
        high = e.load(block, 128 + 32 * h, _I8, 32)
        for low, shift in ((a_lo, 0), (b_lo, 2), (a_hi, 4), (b_hi, 6)):
            two_bits = b.and_(b.lshr(high, e.const(_I8, 32, shift)), e.const(_I8, 32, 3))
            levels.append(b.or_(low, b.shl(two_bits, e.const(_I8, 32, 4))))
    scales = b.fmul(e.splat(e.half(block, 208), 16), b.sitofp(e.load(block, 192, _I8, 16), _vec(_F32, 16)))
    return _Block(levels, scales, bias=32, per16=True)


def _unpack_q8_0(e, block):
    """Q8_0 (34 bytes): d (f16), 32 int8 levels."""
    return _Block([e.load(block, 2, _I8, 32)], e.splat(e.half(block, 0), 1), signed=True)


def _q5_levels(e, block, qh_offset):
    """The 32 levels (0..31) of a Q5_0 / Q5_1 block: fifth bits (a uint32) at `qh_offset`,
    then 16 bytes of nibbles (low: weights 0-15, high: weights 16-31)."""
    b = e.b
    low, high = e.nibbles(e.load(block, qh_offset + 4, _I8, 16))
    fifth = b.zext(b.bitcast(e.load(block, qh_offset, _I32), _vec(_I1, 32)), _vec(_I8, 32))
    return b.or_(e.shuffle(low, high, range(32)), b.shl(fifth, e.const(_I8, 32, 4)))


def _unpack_q5_0(e, block):
    """Q5_0 (22 bytes): d (f16), fifth bits, nibbles. Levels 0..31 stand for -16..15."""
    return _Block([_q5_levels(e, block, 2)], e.splat(e.half(block, 0), 1), bias=16)


def _unpack_q5_1(e, block):
    """Q5_1 (24 bytes): d, m (f16), fifth bits, nibbles; weight = d * level + m."""
    return _Block([_q5_levels(e, block, 4)], e.splat(e.half(block, 0), 1),
                  offsets=e.splat(e.half(block, 2), 1))


_UNPACK = {"Q4_K": _unpack_q4_k, "Q5_K": _unpack_q5_k, "Q6_K": _unpack_q6_k,
           "Q8_0": _unpack_q8_0, "Q5_0": _unpack_q5_0, "Q5_1": _unpack_q5_1}
assert set(_UNPACK) == set(FAST_ENCODINGS)


def _pair_sums(e, sums):
    """Sums of neighbouring lanes: per-16 sums -> per-32 sums."""
    n = sums.type.count
    return e.b.fadd(e.pick(sums, range(0, n, 2)), e.pick(sums, range(1, n, 2)))


def _int8_dot(e, block, xq, xd, xs):
    """IR: <8 x float> whose lanes sum to the dot of an unpacked block with the int8
    activation at xq (levels), xd (scales per 32) and xs (scaled sums per 16)."""
    b = e.b
    act_scales = e.load(xd, 0, _F32, len(block.levels))
    if not block.per16:
        scales = b.fmul(block.scales, act_scales)
    terms = []
    for j, level in enumerate(block.levels):
        x = e.load(xq, 32 * j, _I8, 32)
        products = e.to_float(e.dot_s8s8(level, x) if block.signed else e.dot_u8s8(level, x))
        if block.per16:  # lanes 0-3 hold the first 16 weights, lanes 4-7 the next 16
            lanes = b.fmul(e.pick(block.scales, [2 * j] * 4 + [2 * j + 1] * 4), e.pick(act_scales, [j] * 8))
        else:
            lanes = e.pick(scales, [j] * 8)
        terms.append((products, lanes))
    total = e.weighted_sum(terms)
    sums16 = e.load(xs, 0, _F32, 2 * len(block.levels))
    sums = sums16 if block.per16 else _pair_sums(e, sums16)
    if block.bias:  # the levels were used without their bias: take bias * scale * sum off
        minus_bias = e.splat(ir.Constant(_F32, -block.bias), sums.type.count)
        total = b.fadd(total, e.fold8(b.fmul(b.fmul(block.scales, sums), minus_bias)))
    if block.offsets is not None:
        total = b.fadd(total, e.fold8(b.fmul(block.offsets, sums)))
    return total


def _dequantized(e, block, j):
    """IR: the 32 float32 weights of sub-block j, exactly as ggml computes them."""
    b = e.b
    wide = (b.sext if block.signed else b.zext)(block.levels[j], _vec(_I32, 32))
    if block.bias:
        wide = b.sub(wide, e.const(_I32, 32, block.bias))
    lanes = [2 * j] * 16 + [2 * j + 1] * 16 if block.per16 else [j] * 32
    values = b.fmul(e.pick(block.scales, lanes), b.sitofp(wide, _vec(_F32, 32)))
    return values if block.offsets is None else b.fadd(values, e.pick(block.offsets, [j] * 32))


def _block_loop(e, encoding, start, count, body):
    """IR loop over `count` blocks of `encoding` from i8* `start`, prefetching ahead:
    body(index, unpacked block)."""
    weights, nbytes = block_size(encoding)
    with cgutils.for_range(e.b, count) as loop:
        block = e.at(start, e.b.mul(loop.index, ir.Constant(_I64, nbytes)))
        for line in range(0, nbytes, CACHE_LINE):
            e.prefetch(e.at(block, PREFETCH_BYTES + line))
        body(loop.index, _UNPACK[encoding](e, block))


def _quantized_encoding(tag):
    encoding = _encoding_of(tag)
    return encoding if encoding in _UNPACK else None


def _int8_rows_codegen(encoding, count):
    """codegen of the int8 dot of a row of blocks with `count` activations at once: each
    block is unpacked once for all of them (one loop of vector IR, vector accumulators)."""
    weights = block_size(encoding)[0]
    # bytes per block of an activation's int8 values, scales (per 32) and sums (per 16)
    strides = (weights, weights // ACT_BLOCK * 4, weights // 16 * 4)

    def codegen(context, builder, sig, args):
        e = _Emitter(context, builder)
        start, nblocks = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3))
        bases = [e.pointer(sig.args[i], args[i]) for i in (4, 5, 6)]
        row_bytes = [builder.mul(nblocks, ir.Constant(_I64, stride)) for stride in strides]
        totals = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 8), [0.0] * 8)) for _ in range(count)]

        def body(index, block):
            for k, total in enumerate(totals):
                q, d, s = (e.at(base, builder.add(builder.mul(ir.Constant(_I64, k), size),
                                                  builder.mul(index, ir.Constant(_I64, stride))))
                           for base, size, stride in zip(bases, row_bytes, strides))
                builder.store(builder.fadd(builder.load(total), _int8_dot(e, block, q, d, s)), total)

        _block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), nblocks, body)
        dots = [e.hsum(builder.load(total)) for total in totals]
        return dots[0] if count == 1 else context.make_tuple(builder, sig.return_type, dots)

    return codegen


@intrinsic
def _row_dot_int8(typingctx, tag, w, offset, nblocks, xq, xd, xs):
    """float32 dot of the `nblocks` blocks at byte `offset` of `w` with one int8 activation
    (xq, xd, xs)."""
    encoding = _quantized_encoding(tag)
    if encoding is None:
        return None
    return types.float32(tag, w, offset, nblocks, xq, xd, xs), _int8_rows_codegen(encoding, 1)


def _row_dots_int8_intrinsic(count):
    @intrinsic
    def row_dots_int8(typingctx, tag, w, offset, nblocks, xq, xd, xs):
        """As _row_dot_int8 for the first `count` rows of int8 activations [n, ...] at once:
        a tuple of `count` float32."""
        encoding = _quantized_encoding(tag)
        if encoding is None:
            return None
        signature = types.UniTuple(types.float32, count)(tag, w, offset, nblocks, xq, xd, xs)
        return signature, _int8_rows_codegen(encoding, count)

    return row_dots_int8


_row_dots_int8 = _row_dots_int8_intrinsic(GROUP)
_row_dots_int8_half = _row_dots_int8_intrinsic(GROUP // 2)


@intrinsic
def _row_dot_float(typingctx, tag, w, offset, nblocks, x):
    """float32 dot of the `nblocks` blocks at byte `offset` of `w` with float32 x, each
    weight dequantized exactly (exact path, one activation)."""
    encoding = _quantized_encoding(tag)
    if encoding is None:
        return None
    weights = block_size(encoding)[0]

    def codegen(context, builder, sig, args):
        e = _Emitter(context, builder)
        start, count = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3))
        act = e.pointer(sig.args[4], args[4])
        total = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 32), [0.0] * 32))

        def body(index, block):
            first = e.at(act, builder.mul(index, ir.Constant(_I64, weights * 4)))
            terms = [(_dequantized(e, block, j), e.load(first, 128 * j, _F32, 32))
                     for j in range(len(block.levels))]
            builder.store(builder.fadd(builder.load(total), e.weighted_sum(terms)), total)

        _block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), count, body)
        return e.hsum(e.fold8(builder.load(total)))

    return types.float32(tag, w, offset, nblocks, x), codegen


@intrinsic
def _dequantize_blocks(typingctx, tag, w, offset, nblocks, out):
    """Dequantize the `nblocks` blocks at byte `offset` of `w` into out[:nblocks * block weights]."""
    encoding = _quantized_encoding(tag)
    if encoding is None:
        return None

    def codegen(context, builder, sig, args):
        e = _Emitter(context, builder)
        start, count = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3))
        values = e.pointer(sig.args[4], args[4])
        block_floats = block_size(encoding)[0] * 4

        def body(index, block):
            first = builder.mul(index, ir.Constant(_I64, block_floats))
            for j in range(len(block.levels)):
                target = builder.bitcast(e.at(values, builder.add(first, ir.Constant(_I64, 128 * j))),
                                         _vec(_F32, 32).as_pointer())
                builder.store(_dequantized(e, block, j), target, align=4)

        _block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), count, body)
        return context.get_dummy_value()

    return types.void(tag, w, offset, nblocks, out), codegen


# ------------------------------------------------------------------ generic row operations


@_njit
def _identity(value):
    return value


# float encodings: (how numpy views the bytes, float32 of one element)
_FLOAT_ELEMENTS = {"F32": (np.float32, _identity), "F16": (np.uint16, _half_to_float),
                   "BF16": (np.uint16, _bf16_to_float)}


def _dequantize_impl(encoding):
    """numba implementation of _dequantize_into for one encoding."""
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


def _dequantize_into(tag, w, offset, count, out):
    """Dequantize `count` weights (whole blocks) from byte `offset` of `w` into out[:count]."""


@overload(_dequantize_into)
def _dequantize_into_overload(tag, w, offset, count, out):
    encoding = _encoding_of(tag)
    return None if encoding is None else _dequantize_impl(encoding)


def _row_dot(tag, w, offset, cols, act):
    """float32 dot of the row of `cols` weights at byte `offset` of `w` with one activation
    (a float32 vector, or an int8 (q, d, sums) tuple)."""


@overload(_row_dot, jit_options={"fastmath": True})
def _row_dot_overload(tag, w, offset, cols, act):
    encoding = _encoding_of(tag)
    if encoding is None:
        return None
    if encoding in _UNPACK:
        weights = block_size(encoding)[0]
        if isinstance(act, types.BaseTuple):
            return lambda tag, w, offset, cols, act: _row_dot_int8(tag, w, offset, cols // weights, *act)
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


def _row_times(tag, w, offset, cols, act, out, r, buf):
    """out[:, r] = the row at byte `offset` of `w` times each of the n activations `act`
    (float32 [n, cols], or an int8 tuple of [n, ...] arrays)."""


@overload(_row_times)
def _row_times_overload(tag, w, offset, cols, act, out, r, buf):
    encoding = _encoding_of(tag)
    if encoding is None:
        return None
    weights, nbytes = block_size(encoding)
    if isinstance(act, types.BaseTuple):
        def int8_impl(tag, w, offset, cols, act, out, r, buf):
            q, d, s = act
            n, nblocks = out.shape[0], cols // weights
            grouped = n - n % GROUP
            for i in range(0, grouped, GROUP):  # each block unpacked once for GROUP activations
                dots = _row_dots_int8(tag, w, offset, nblocks, q[i:], d[i:], s[i:])
                for k in range(GROUP):
                    out[i + k, r] = dots[k]
            if n - grouped >= GROUP // 2:
                dots = _row_dots_int8_half(tag, w, offset, nblocks, q[grouped:], d[grouped:], s[grouped:])
                for k in range(GROUP // 2):
                    out[grouped + k, r] = dots[k]
                grouped += GROUP // 2
            for i in range(grouped, n):
                out[i, r] = _row_dot_int8(tag, w, offset, nblocks, q[i], d[i], s[i])
        return int8_impl

    def float_impl(tag, w, offset, cols, act, out, r, buf):
        if out.shape[0] == 1:
            out[0, r] = _row_dot(tag, w, offset, cols, act[0])
            return
        out[:, r] = 0.0
        for first in range(0, cols, CHUNK):  # each chunk is dequantized once for all n
            count = min(CHUNK, cols - first)
            _dequantize_into(tag, w, offset + first // weights * nbytes, count, buf)
            for i in range(out.shape[0]):
                out[i, r] += _dot(buf, act[i, first:], count)
    return float_impl


def _act_row(act, i):
    """Activation i of a batch (a row of a float32 matrix, or of each int8 tuple array)."""


@overload(_act_row)
def _act_row_overload(act, i):
    if isinstance(act, types.BaseTuple):
        return lambda act, i: (act[0][i], act[1][i], act[2][i])
    return lambda act, i: act[i]


# ------------------------------------------------------------------ int8 activations


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_range(values, q, d, sums, start, stop):
    """Quantize values[start:stop] (whole blocks of 32) to int8: levels q, scales d (one per
    32) and sums (d times the sum of the levels of each 16)."""
    for b in range(start // ACT_BLOCK, stop // ACT_BLOCK):
        block, levels = values[b * ACT_BLOCK:(b + 1) * ACT_BLOCK], q[b * ACT_BLOCK:(b + 1) * ACT_BLOCK]
        amax = F32(0.0)
        for i in range(ACT_BLOCK):
            amax = max(amax, abs(block[i]))
        scale = amax / F32(127.0)
        inverse = F32(127.0) / amax if amax > 0 else F32(0.0)
        d[b] = scale
        for half in range(2):
            total = np.int32(0)
            for i in range(16 * half, 16 * half + 16):
                level = np.int32(np.rint(block[i] * inverse))
                levels[i] = level
                total += level
            sums[2 * b + half] = scale * F32(total)


@_njit
def _quantize_activations(x):
    """float32 [n, cols] -> (q int8 [n, cols], d float32 [n, cols/32], sums float32 [n, cols/16])."""
    n, cols = x.shape
    q = np.empty((n, cols), np.int8)
    d = np.empty((n, cols // ACT_BLOCK), np.float32)
    sums = np.empty((n, cols // 16), np.float32)
    for i in range(n):
        _quantize_range(x[i], q[i], d[i], sums[i], 0, cols)
    return q, d, sums


def _finish_activation(act, values, start, stop):
    """Make values.flat[start:stop] usable as `act`: quantize it into an int8 tuple, or
    nothing when `act` is `values` itself (float path)."""


@overload(_finish_activation)
def _finish_activation_overload(act, values, start, stop):
    if isinstance(act, types.BaseTuple):
        def quantize(act, values, start, stop):
            q, d, sums = act
            _quantize_range(values.reshape(-1), q.reshape(-1), d.reshape(-1), sums.reshape(-1), start, stop)
        return quantize
    return lambda act, values, start, stop: None


# ------------------------------------------------------------------ parallel kernels


@_njit
def _share(count, parts, part, align):
    """Rows [first, stop) of `part` when `count` rows are cut into `parts` contiguous ranges
    whose bounds are multiples of `align`."""
    units = (count + align - 1) // align
    return min(count, units * part // parts * align), min(count, units * (part + 1) // parts * align)


@_njit
def _silu(v):
    return v / (F32(1.0) + np.exp(-v))


@_parallel
def _matmul_kernel(tag, w, rows, cols, row_nbytes, act, out, nthreads):
    for t in prange(nthreads):
        first, stop = _share(rows, nthreads, t, 1)
        buf = np.empty(CHUNK, np.float32)
        for r in range(first, stop):
            _row_times(tag, w, r * row_nbytes, cols, act, out, r, buf)


@_parallel
def _per_head_kernel(tag, w, cols, row_nbytes, act, heads, stride, first, out, nthreads):
    groups, rows = out.shape
    for t in prange(nthreads):
        lo, hi = _share(groups * rows, nthreads, t, 1)
        for index in range(lo, hi):
            g, r = index // rows, index % rows
            row = first + (g % heads) * stride + r
            out[g, r] = _row_dot(tag, w, row * row_nbytes, cols, _act_row(act, g))


@_parallel
def _dequantize_kernel(tag, w, first_row, cols, row_nbytes, out, nthreads):
    for t in prange(nthreads):
        first, stop = _share(out.shape[0], nthreads, t, 1)
        for r in range(first, stop):
            _dequantize_into(tag, w, (first_row + r) * row_nbytes, cols, out[r])


@_parallel
def _moe_kernel(gate_tag, up_tag, down_tag, records, slots, offsets, row_nbytes, ffn, hidden,
                gate_act, up_act, h, h_act, weights, out, nthreads):
    k = slots.shape[0]
    # 1. h[j, i] = silu(gate_j[i] . x) * (up_j[i] . x), over all k * ffn rows at once; each
    #    thread then quantizes its own (32-aligned) part of h for the down projection.
    for t in prange(nthreads):
        first, stop = _share(k * ffn, nthreads, t, ACT_BLOCK)
        for index in range(first, stop):
            j, i = index // ffn, index % ffn
            record = records[slots[j]]
            gate = _row_dot(gate_tag, record, offsets[0] + i * row_nbytes[0], hidden, gate_act)
            up = _row_dot(up_tag, record, offsets[1] + i * row_nbytes[1], hidden, up_act)
            h[j, i] = _silu(gate) * up
        _finish_activation(h_act, h, first, stop)
    # 2. out[r] = sum_j weights[j] * (down_j[r] . h[j]), one expert's rows at a time.
    for t in prange(nthreads):
        first, stop = _share(hidden, nthreads, t, 1)
        out[first:stop] = 0.0
        for j in range(k):
            act = _act_row(h_act, j)
            record = records[slots[j]]
            for r in range(first, stop):
                out[r] += weights[j] * _row_dot(down_tag, record, offsets[2] + r * row_nbytes[2], ffn, act)


@_njit
def _silu_times(gate, up):
    """gate <- silu(gate) * up, elementwise."""
    flat_gate, flat_up = gate.reshape(-1), up.reshape(-1)
    for i in range(flat_gate.size):
        flat_gate[i] = _silu(flat_gate[i]) * flat_up[i]
    return gate


# ------------------------------------------------------------------ attention and norms


def _as_f32(v):
    """float32 of a KV cache element: float16 bits (uint16) or a float32."""


@overload(_as_f32)
def _as_f32_overload(v):
    if isinstance(v, types.Integer):
        return lambda v: _half_to_float(v)
    return lambda v: F32(v)


def _attention_loops(q, keys, values, start, scale, out, nthreads):
    n, heads, width = q.shape
    group = heads // keys.shape[1]
    for t in prange(nthreads):
        first, stop = _share(n * heads, nthreads, t, 1)
        scores = np.empty(start + n, np.float32)
        for work in range(first, stop):
            i, h = work // heads, work % heads
            kv, end = h // group, start + i + 1  # causal: query i sees positions 0..start+i
            best = F32(-3.0e38)
            for pos in range(end):
                score = F32(0.0)
                for d in range(width):
                    score += q[i, h, d] * _as_f32(keys[pos, kv, d])
                scores[pos] = score * scale
                best = max(best, scores[pos])
            total = F32(0.0)
            for pos in range(end):
                scores[pos] = np.exp(scores[pos] - best)
                total += scores[pos]
            out[i, h, :] = 0.0
            for pos in range(end):
                weight = scores[pos] / total
                for d in range(values.shape[2]):
                    out[i, h, d] += weight * _as_f32(values[pos, kv, d])


# A decode step's attention is too small to pay for waking the threads; long contexts and
# prompts are not.
_attention_serial = njit(cache=True, nogil=True, fastmath=True)(_attention_loops)
_attention_parallel = njit(cache=True, nogil=True, parallel=True, fastmath=True)(_attention_loops)
PARALLEL_ATTENTION_WORK = 1 << 20  # multiply-adds from which attention runs on all threads


@njit(cache=True, nogil=True, fastmath=True)
def _rms_norm_kernel(x, weight, eps, out):
    for i in range(x.shape[0]):
        total = F32(0.0)
        for j in range(x.shape[1]):
            total += x[i, j] * x[i, j]
        inverse = F32(1.0) / np.sqrt(total / F32(x.shape[1]) + eps)
        for j in range(x.shape[1]):
            out[i, j] = x[i, j] * inverse * weight[j]


# ------------------------------------------------------------------ public API

_warned_workqueue = False


def set_threads(n: int) -> None:
    """Use `n` threads in the kernels (numba.set_num_threads); warns once when numba runs on
    its `workqueue` threading layer, whose ~0.1 ms per parallel call ruins decode speed."""
    global _warned_workqueue
    numba.set_num_threads(n)
    if numba.threading_layer() == "workqueue" and not _warned_workqueue:
        _warned_workqueue = True
        warnings.warn("numba is using its 'workqueue' threading layer: every kernel call costs ~0.1 ms. "
                      "Install an OpenMP runtime or tbb (pip install tbb) and set NUMBA_THREADING_LAYER=omp "
                      "or tbb.", RuntimeWarning, stacklevel=2)


def _fast(encoding: str, exact: bool) -> bool:
    """Whether a product with `encoding` weights takes the int8 (fast) path."""
    return not exact and encoding in FAST_ENCODINGS


def _weights(w: np.ndarray, encoding: str, rows: int, cols: int) -> tuple[np.ndarray, int]:
    """`w` as a flat uint8 array of at least `rows` rows of `cols` weights, and the row size."""
    nbytes = row_bytes(encoding, cols)
    w = np.ascontiguousarray(w).reshape(-1)
    if w.dtype != np.uint8:
        raise ValueError(f"weights must be uint8 bytes, got {w.dtype}")
    if w.size < rows * nbytes:
        raise ValueError(f"{rows} rows of {cols} {encoding} weights need {rows * nbytes} bytes, got {w.size}")
    return w, nbytes


def _float_rows(x: np.ndarray, cols: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"activations must have shape [n, {cols}], got {x.shape}")
    return x


def _activation(x: np.ndarray, fast: bool):
    """float32 [n, cols] as the kernels take it: quantized to int8 for the fast path."""
    return _quantize_activations(x) if fast else x


class Matrix:
    """A [rows, cols] weight matrix in its stored encoding, checked once and then multiplied
    many times: the per-call work of a decode step is one activation and one kernel call."""

    def __init__(self, w: np.ndarray, encoding: str, rows: int, cols: int, exact: bool = False):
        self.data, self.row_nbytes = _weights(w, encoding, rows, cols)
        self.encoding, self.rows, self.cols = encoding, rows, cols
        self.tag = BLOCK_TAGS[encoding]
        self.fast = _fast(encoding, exact)

    def activation(self, x: np.ndarray):
        """x float32 [n, cols] as this matrix's kernel takes it; share it between matrices of
        the same `fast` that multiply the same x."""
        return _activation(_float_rows(x, self.cols), self.fast)

    def times(self, act, n: int) -> np.ndarray:
        """The product with an activation from `activation` of n rows -> float32 [n, rows]."""
        out = np.empty((n, self.rows), np.float32)
        _matmul_kernel(self.tag, self.data, self.rows, self.cols, self.row_nbytes, act, out, numba.get_num_threads())
        return out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x float32 [n, cols] -> float32 [n, rows]."""
        return self.times(self.activation(x), x.shape[0])

    def times_per_head(self, x: np.ndarray, heads: int, rows: int, stride: int, first: int = 0) -> np.ndarray:
        """x float32 [n * heads, cols], row g belonging to head g % heads, times that head's
        `rows` rows (first + head * stride onwards) -> float32 [n * heads, rows]: a slice of
        the matrix per head, as MLA's absorbed projections need."""
        if first + (heads - 1) * stride + rows > self.rows or x.shape[0] % heads:
            raise ValueError(f"{heads} heads of {rows} rows every {stride} from {first} do not fit {self.rows} rows")
        out = np.empty((x.shape[0], rows), np.float32)
        _per_head_kernel(self.tag, self.data, self.cols, self.row_nbytes, self.activation(x), heads, stride, first, out,
                         numba.get_num_threads())
        return out

    def rows_f32(self, first: int, count: int) -> np.ndarray:
        return dequantize_rows(self.data, self.encoding, self.cols, first, count)


def matmul(w: np.ndarray, encoding: str, rows: int, cols: int, x: np.ndarray, exact: bool = False) -> np.ndarray:
    """x float32 [n, cols] times the [rows, cols] matrix `w` (transposed) -> float32 [n, rows]
    (prefill). `exact=True` multiplies in float32 instead of with int8 activations."""
    return Matrix(w, encoding, rows, cols, exact)(x)


def matvec(w: np.ndarray, encoding: str, rows: int, cols: int, x: np.ndarray, exact: bool = False) -> np.ndarray:
    """The [rows, cols] matrix `w` times x float32 [cols] -> float32 [rows] (decode).
    `exact=True` multiplies in float32 instead of with int8 activations."""
    x = np.asarray(x)
    if x.shape != (cols,):
        raise ValueError(f"x must have shape ({cols},), got {x.shape}")
    return matmul(w, encoding, rows, cols, x.reshape(1, cols), exact)[0]


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, scale: float) -> np.ndarray:
    """Causal softmax attention of the n queries at positions start..start+n-1.

    q float32 [n, heads, width]; keys [start + n, kv_heads, width] and values [start + n,
    kv_heads, v_width] as float32 or as float16 bits (uint16, read in place from an f16 KV
    cache); query head h reads kv head h // (heads / kv_heads) -> float32 [n, heads, v_width]."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    n, heads, width = q.shape
    if keys.shape[0] != start + n or values.shape[0] != start + n or keys.shape[2] != width or heads % keys.shape[1]:
        raise ValueError(f"keys {keys.shape} / values {values.shape} do not fit queries {q.shape} at position {start}")
    out = np.empty((n, heads, values.shape[2]), np.float32)
    work = n * heads * (start + n) * (width + values.shape[2])
    if work >= PARALLEL_ATTENTION_WORK:
        _attention_parallel(q, keys, values, start, F32(scale), out, numba.get_num_threads())
    else:
        _attention_serial(q, keys, values, start, F32(scale), out, 1)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * weight over the last axis (float32)."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    _rms_norm_kernel(rows, np.ascontiguousarray(weight, dtype=np.float32), F32(eps), out)
    return out.reshape(x.shape)


def dequantize_rows(w: np.ndarray, encoding: str, cols: int, first: int, count: int) -> np.ndarray:
    """Rows first .. first+count-1 of the matrix `w` as float32 [count, cols] (embedding lookup)."""
    if first < 0 or count < 0:
        raise ValueError(f"bad row range: first={first}, count={count}")
    w, nbytes = _weights(w, encoding, first + count, cols)
    out = np.empty((count, cols), np.float32)
    _dequantize_kernel(BLOCK_TAGS[encoding], w, first, cols, nbytes, out, numba.get_num_threads())
    return out


class ExpertKernel:
    """sum_j weights[j] * down_j(silu(gate_j @ x) * (up_j @ x)) for the k routed experts of one
    layer in one call (decode); encodings, offsets and sizes are checked once, here.

    An expert is a row of `records` (uint8 [m, record_bytes]) with gate [ffn, hidden], up
    [ffn, hidden] and down [hidden, ffn] at byte `offsets` in `encodings`. With int8
    activations (exact=False), x is quantized once for every gate and up, and each expert's
    hidden state once for its down."""

    def __init__(self, record_bytes: int, encodings: tuple[str, str, str], offsets: tuple[int, int, int], ffn: int,
                 hidden: int, exact: bool = False):
        shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
        self.sizes = tuple(row_bytes(encoding, cols) for encoding, (_, cols) in zip(encodings, shapes))
        for name, offset, (rows, _), size in zip(("gate", "up", "down"), offsets, shapes, self.sizes):
            if offset < 0 or offset + rows * size > record_bytes:
                raise ValueError(f"{name} [{rows} rows of {size} bytes] at offset {offset} does not fit "
                                 f"in a record of {record_bytes} bytes")
        self.record_bytes, self.ffn, self.hidden = record_bytes, ffn, hidden
        self.tags = tuple(BLOCK_TAGS[encoding] for encoding in encodings)
        self.offsets = tuple(int(o) for o in offsets)
        self.fast = tuple(_fast(encoding, exact) for encoding in encodings)

    def __call__(self, records: np.ndarray, slots: np.ndarray, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """records uint8 [m, >= record_bytes] (C-contiguous, e.g. a cache slab used in place),
        slots int64 [k] (the experts' rows), x float32 [hidden], weights float32 [k] -> float32 [hidden]."""
        k, ffn = slots.shape[0], self.ffn
        x = x.reshape(1, self.hidden)
        quantized = _quantize_activations(x) if self.fast[0] or self.fast[1] else None
        gate_act, up_act = ((tuple(a[0] for a in quantized) if fast else x[0]) for fast in self.fast[:2])
        h = np.empty((k, ffn), np.float32)
        h_act = h
        if self.fast[2]:
            h_act = (np.empty((k, ffn), np.int8), np.empty((k, ffn // ACT_BLOCK), np.float32),
                     np.empty((k, ffn // 16), np.float32))
        out = np.empty(self.hidden, np.float32)
        _moe_kernel(*self.tags, records, slots, self.offsets, self.sizes, ffn, self.hidden, gate_act, up_act, h, h_act,
                    weights, out, numba.get_num_threads())
        return out

    def batch(self, record: np.ndarray, x: np.ndarray) -> np.ndarray:
        """One expert (its record, contiguous uint8 [>= record_bytes]) applied to each row of x
        float32 [n, hidden] -> float32 [n, hidden], without a routing weight (prefill)."""
        n = x.shape[0]
        quantized = _quantize_activations(x) if self.fast[0] or self.fast[1] else None
        gate, up = (self._project(record, m, self.ffn, self.hidden, quantized if self.fast[m] else x, n) for m in (0, 1))
        return self._project(record, 2, self.hidden, self.ffn, _activation(_silu_times(gate, up), self.fast[2]), n)

    def _project(self, record: np.ndarray, m: int, rows: int, cols: int, act, n: int) -> np.ndarray:
        out = np.empty((n, rows), np.float32)
        _matmul_kernel(self.tags[m], record[self.offsets[m]:], rows, cols, self.sizes[m], act, out, numba.get_num_threads())
        return out


def moe_experts(records: np.ndarray, encodings: tuple[str, str, str], offsets: tuple[int, int, int], ffn: int,
                hidden: int, x: np.ndarray, weights: np.ndarray, exact: bool = False,
                slots: np.ndarray | None = None) -> np.ndarray:
    """`ExpertKernel` on experts `slots` of `records` (default: all of its rows), with checks of
    every argument: x float32 [hidden], weights float32 [k] -> float32 [hidden]."""
    if records.dtype != np.uint8 or records.ndim != 2 or not records.flags.c_contiguous:
        raise ValueError(f"records must be C-contiguous uint8 [m, record_bytes], got {records.dtype} {records.shape}")
    slots = np.arange(records.shape[0]) if slots is None else np.asarray(slots, dtype=np.int64).reshape(-1)
    if slots.size and (slots.min() < 0 or slots.max() >= records.shape[0]):
        raise ValueError(f"slots {slots.tolist()} out of range for {records.shape[0]} records")
    weights = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
    if weights.shape != slots.shape:
        raise ValueError(f"weights must have shape ({slots.shape[0]},), got {weights.shape}")
    x = _float_rows(np.asarray(x).reshape(1, -1), hidden)[0]
    return ExpertKernel(records.shape[1], encodings, offsets, ffn, hidden, exact)(records, slots, x, weights)


def moe_experts_batch(record: np.ndarray, encodings: tuple[str, str, str], offsets: tuple[int, int, int],
                      ffn: int, hidden: int, x: np.ndarray, exact: bool = False) -> np.ndarray:
    """`ExpertKernel.batch` with checks of every argument: one expert (`record`, its bytes as a
    row of moe_experts') applied to each row of x float32 [n, hidden] -> float32 [n, hidden]."""
    record = np.ascontiguousarray(record).reshape(-1)
    if record.dtype != np.uint8:
        raise ValueError(f"record must be uint8 bytes, got {record.dtype}")
    return ExpertKernel(record.size, encodings, offsets, ffn, hidden, exact).batch(record, _float_rows(x, hidden))


@_parallel
def _read_stream(words, nthreads):
    """XOR of every word, each thread over one contiguous range: a pure read stream."""
    partial = np.zeros(nthreads, np.uint64)
    for t in prange(nthreads):
        part = words[words.size * t // nthreads:words.size * (t + 1) // nthreads]
        acc = np.uint64(0)
        for i in range(part.size):  # indices from 0: no negative-index checks, vectorized
            acc ^= part[i]
        partial[t] = acc
    return partial


def read_seconds(words: np.ndarray, threads: int) -> float:
    """Seconds one pass of `threads` read streams takes over `words` (uint64)."""
    import time

    started = time.perf_counter()
    _read_stream(words, threads)
    return time.perf_counter() - started


def measure_read_bandwidth(nbytes: int = 256 << 20, threads: int | None = None, repeat: int = 3) -> float:
    """Bytes/s that `threads` (default: numba's count) contiguous read streams reach: the
    memory bandwidth a weight-streaming kernel can hope for (median of `repeat`)."""
    threads = threads or numba.get_num_threads()
    words = np.ones(nbytes // 8, np.uint64)
    read_seconds(words, threads)  # compile, and touch the pages
    return nbytes / sorted(read_seconds(words, threads) for _ in range(repeat))[repeat // 2]

