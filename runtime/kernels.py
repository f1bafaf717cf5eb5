"""Fused dequantize-and-multiply kernels for the colibri block encodings (numba).

A weight matrix is a flat uint8 array of `rows * row_bytes` bytes in one of the encodings of
`formats/encodings.py` (GGML blocks, see `formats/spec.md` §2). A product takes one of three
paths, chosen per call by `exact`, the number of rows and the CPU:

- **fast** (`exact=False`, the default; Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q5_1): the activation
  is quantized to int8 as ggml does (`DOT_TYPES`): in Q8_K blocks of 256 values for the
  K-quants, whose sub-block products then stay integer to the end of a block, and in Q8_0
  blocks of 32 for the others; both keep the scaled sum of each 16 values for the blocks'
  offsets and minimums. The dot of a whole row is one `@intrinsic` that emits LLVM IR:
  `vpmaddubsw` + `vpdpwssd` on 64 bytes at a time with AVX-512 (K-quants), `vpdpbusd` with
  AVX-VNNI, `vpmaddubsw` + `vpmaddwd` with AVX2, and portable vector IR on other CPUs.
  `matmul` unpacks each weight block once for GROUP rows of x, and passes each group over a
  tile of ROW_TILE rows. Error: see `FAST_PATH_TOLERANCE`.
- **tiles** (fast path, prompts of at least `amx.MIN_TOKENS` rows, CPUs with AMX): each
  block of 32 weight rows is dequantized to bfloat16 once and every token passes over it on
  the AMX tiles (`runtime/amx.py`): 2-3x the int8 kernels' multiply-adds per second for
  K-quants and ~10x for Q8_0 (bench/kernels.py, 64 tokens, dequantization included); error
  2.5e-3 (bfloat16), below the int8 path's.
- **exact** (`exact=True`, and always for F32, F16 and BF16): each weight is dequantized to
  the float32 that `gguf.quants.dequantize` gives (bit for bit) and multiplied with the
  float32 activation. `matmul` dequantizes each chunk of 256 weights once for all rows of x.

Each quantized block type is described once, as LLVM IR that unpacks a block (`_unpack_*`);
the int8 dot product, the exact dot product and the dequantizer are built from it.

An encoding reaches compiled code as a compile-time tag, the numpy dtype of one of its
blocks (`BLOCK_TAGS`), so numba compiles one specialization per encoding, and only for the
encodings a program uses. An activation is a float32 array (exact path), a
`Q8_0Activation` / `Q8_KActivation` named tuple (fast path; numba tells them apart by type)
or an `amx.TileActivation` (tiles);
the kernels are generic over all three, and one quantized activation serves every matrix of
its dot type that multiplies it (q, k and v; gate and up; all the experts of a layer).

Threads: each parallel kernel gives thread `t` one contiguous range of rows (one memory
stream per thread) and prefetches `PREFETCH_BYTES` ahead of the block it multiplies. Numba's
`workqueue` threading layer costs ~0.1 ms per parallel call; `set_threads` warns about it.
"""

from __future__ import annotations

import warnings
from collections import namedtuple

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from colibri.formats.encodings import ENCODINGS, block_size, row_bytes
from colibri.runtime import amx

F32 = np.float32
CHUNK = 256  # weights dequantized at a time by the exact path (a multiple of every block size)
# The int8 activation format each block type is multiplied with, as in ggml: K-quants take
# Q8_K (one float32 scale per 256 values), so that a block's sub-block products stay integer
# to the end of the block; the 32-weight block types take Q8_0 (a float32 scale per 32).
# Both also hold the scaled sum of each 16 values, for the blocks' offsets and biases:
# q int8 [n, cols], d float32 [n, cols / block], sums float32 [n, cols / 16].
DOT_TYPES = {"Q8_0": "Q8_0", "Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K"}
ACT_BLOCKS = {"Q8_0": 32, "Q8_K": 256}  # activation values per int8 scale
WIDEST_ACT_BLOCK = 256
Q8_0Activation = namedtuple("Q8_0Activation", "q d sums")
Q8_KActivation = namedtuple("Q8_KActivation", "q d sums")
ACTIVATIONS = {"Q8_0": Q8_0Activation, "Q8_K": Q8_KActivation}
GROUP = 8  # activations multiplied together by the int8 matmul (each weight block unpacked once);
# a remainder of at least GROUP // 2 rows is done as one half group
ROW_TILE = 32  # weight rows the int8 matmul passes each group of activations over (kept in L2)
PREFETCH_BYTES = 4096  # how far ahead of the current block the weight stream is prefetched
CACHE_LINE = 64

# Error of the fast path relative to the output's max-abs, against float64 products of the
# same weights (rows of 2048, 40 cases per encoding). Gaussian activations: median 5e-3,
# worst 1.0e-2 with Q8_0 activations; median 7e-3, worst 1.3e-2 with Q8_K. Heavy-tailed
# (Student t, 3 degrees of freedom): worst 1.4e-2 with Q8_0, 3.7e-2 with Q8_K, whose one
# scale per 256 an outlier coarsens for more values. ggml's activations cost the same.
FAST_PATH_TOLERANCE = 1.5e-2
FAST_ENCODINGS = tuple(DOT_TYPES)

# `_Emitter.add_pair_products` emits vpdpwssd as inline assembly, which LLVM parses
llvmlite.binding.initialize_native_asmparser()

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
    """LLVM IR building blocks for the CPU numba compiles for: AVX-512, AVX-VNNI or AVX2 dot
    products and F16C conversions where the target has them, portable IR otherwise."""

    def __init__(self, context, builder):
        triple, _, features = context.codegen().magic_tuple()
        enabled = {f[1:] for f in features.split(",") if f.startswith("+")}
        x86 = triple.startswith(("x86_64", "i386", "i686"))
        self.context, self.b = context, builder
        self.avx2 = x86 and "avx2" in enabled
        self.vnni = self.avx2 and ("avxvnni" in enabled or {"avx512vnni", "avx512vl"} <= enabled)
        self.avx512 = x86 and "avx512bw" in enabled  # 64-byte integer multiplies
        self.vnni512 = self.avx512 and "avx512vnni" in enabled
        self.native_half = not x86 or "f16c" in enabled
        self.multiply_bytes = 64 if self.avx512 else 32  # bytes per vector of `pair_products`

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
            return self.add_pair_products(self.const(_I32, 8, 0), self.pair_products(unsigned, signed),
                                          self.const(_I16, 16, 1))
        wide = _vec(_I32, 32)
        return self._sum_quads(b.mul(b.zext(unsigned, wide), b.sext(signed, wide)))

    def pair_products(self, unsigned, signed):
        """<n/2 x i16>, lane m = unsigned[2m] * signed[2m] + unsigned[2m + 1] * signed[2m + 1]
        (n = 32 bytes, or 64 with AVX-512). Callers keep every pair sum within int16
        (vpmaddubsw saturates)."""
        n = unsigned.type.count
        if self.avx2 and n == 32 or self.avx512 and n == 64:
            name = "llvm.x86.avx2.pmadd.ub.sw" if n == 32 else "llvm.x86.avx512.pmaddubs.w.512"
            return self.call(name, _vec(_I16, n // 2), unsigned, signed)
        b, wide = self.b, _vec(_I16, n)
        products = b.mul(b.zext(unsigned, wide), b.sext(signed, wide))
        return b.add(self.pick(products, range(0, n, 2)), self.pick(products, range(1, n, 2)))

    def add_pair_products(self, acc, left, right):
        """acc <n/2 x i32> plus, in lane m, left[2m] * right[2m] + left[2m + 1] * right[2m + 1]
        (<n x i16> each, n = 16 or 32): one vpdpwssd with VNNI, vpmaddwd + vpaddd otherwise.
        With AVX-512 VNNI the vpdpwssd is inline assembly: from LLVM's intrinsic, its machine
        combiner splits chains of them into vpmaddwd + vpaddd to shorten their latency, which
        costs a throughput-bound loop like ours 10-15%."""
        b, n = self.b, left.type.count
        as_i32 = _vec(_I32, n // 2)
        operands = [acc, b.bitcast(left, as_i32), b.bitcast(right, as_i32)]
        if self.vnni512 and n in (16, 32):
            return b.asm(ir.FunctionType(as_i32, [as_i32] * 3), "vpdpwssd $3, $2, $0", "=v,0,v,v", operands, False)
        if n == 16 and self.vnni:
            return self.call("llvm.x86.avx512.vpdpwssd.256", as_i32, *operands)
        if n == 16 and self.avx2 or n == 32 and self.avx512:
            name = "llvm.x86.avx2.pmadd.wd" if n == 16 else "llvm.x86.avx512.pmaddw.d.512"
            return b.add(acc, self.call(name, as_i32, left, right))
        products = b.mul(b.sext(left, _vec(_I32, n)), b.sext(right, _vec(_I32, n)))
        return b.add(acc, b.add(self.pick(products, range(0, n, 2)), self.pick(products, range(1, n, 2))))

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
def _int_bits_to_float(typingctx, bits):
    """The float32 whose bits are the low 32 of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], _I32) if bits.bitwidth > 32 else args[0], _F32)

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
    sub-block or None. The order of the float operations is ggml's (and gguf's).

    K-quant blocks also carry their integer form, for the dot with Q8_K activations
    (`_k_int8_dot`): `d * sum_m int_scales[m // pairs_per_scale] * (level_2m x_2m + level_2m+1
    x_2m+1)` over the 128 pairs of weights, plus `offsets16 . (the sum of x over each 16)`;
    `int_scales` is a <16 x i16>, `offsets16` a <16 x float>."""

    def __init__(self, levels, scales, signed=False, bias=0, offsets=None, per16=False,
                 d=None, int_scales=None, pairs_per_scale=None, offsets16=None):
        self.levels, self.scales, self.signed, self.bias = levels, scales, signed, bias
        self.offsets, self.per16 = offsets, per16
        self.d, self.int_scales, self.pairs_per_scale, self.offsets16 = d, int_scales, pairs_per_scale, offsets16


def _k_scales(e, block, offset):
    """IR: the 6-bit scales (lanes 0-7) and mins (lanes 8-15) of a Q4_K / Q5_K block as a
    <16 x i8>, unpacked as ggml does from the 12 bytes at `offset` (sub-blocks 0-3 in the low
    bits of bytes 0-7, sub-blocks 4-7 in bytes 8-11 and the top bits of bytes 0-7)."""
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
    return b.bitcast(packed, _vec(_I8, 16))


def _k_block(e, block, levels):
    """A Q4_K / Q5_K block from its `levels`: d, dmin (f16) at bytes 0 and 2, the packed
    scales and mins at byte 4."""
    b = e.b
    packed = _k_scales(e, block, 4)
    values = b.uitofp(packed, _vec(_F32, 16))
    d, dmin = e.half(block, 0), e.half(block, 2)
    offsets = b.fneg(b.fmul(e.splat(dmin), e.pick(values, range(8, 16))))
    return _Block(levels, b.fmul(e.splat(d), e.pick(values, range(8))), offsets=offsets,
                  d=d, int_scales=b.zext(packed, _vec(_I16, 16)), pairs_per_scale=16,
                  offsets16=e.pick(offsets, [j // 2 for j in range(16)]))


def _unpack_q4_k(e, block):
    """Q4_K (144 bytes): d, dmin (f16); 12 bytes of 6-bit scales and mins; 128 bytes of
    nibbles, low nibbles of bytes 32g.. for sub-block 2g, high nibbles for 2g + 1."""
    return _k_block(e, block, [q for g in range(4) for q in e.nibbles(e.load(block, 16 + 32 * g, _I8, 32))])


def _unpack_q5_k(e, block):
    """Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits (bit j for sub-block j)
    between the scales and the nibbles."""
    b = e.b
    high_bits = e.load(block, 16, _I8, 32)
    levels = []
    for g in range(4):
        for j, q in zip((2 * g, 2 * g + 1), e.nibbles(e.load(block, 48 + 32 * g, _I8, 32))):
            fifth = b.and_(b.lshr(high_bits, e.const(_I8, 32, j)), e.const(_I8, 32, 1))
            levels.append(b.or_(q, b.shl(fifth, e.const(_I8, 32, 4))))
    return _k_block(e, block, levels)


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
    d, packed = e.half(block, 208), e.load(block, 192, _I8, 16)
    scales = b.fmul(e.splat(d, 16), b.sitofp(packed, _vec(_F32, 16)))
    return _Block(levels, scales, bias=32, per16=True,
                  d=d, int_scales=b.sext(packed, _vec(_I16, 16)), pairs_per_scale=8,
                  offsets16=b.fmul(scales, e.splat(ir.Constant(_F32, -32.0), 16)))


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


def _int8_dot(e, block, xq, xd, xs, total):
    """IR: `total` (<8 x float>) plus lanes that sum to the dot of an unpacked block with
    the Q8_0 activation at xq (levels), xd (scales per 32) and xs (scaled sums per 16)."""
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
    total = b.fadd(total, e.weighted_sum(terms))
    sums16 = e.load(xs, 0, _F32, 2 * len(block.levels))
    sums = sums16 if block.per16 else _pair_sums(e, sums16)
    if block.bias:  # the levels were used without their bias: take bias * scale * sum off
        minus_bias = e.splat(ir.Constant(_F32, -block.bias), sums.type.count)
        total = b.fadd(total, e.fold8(b.fmul(b.fmul(block.scales, sums), minus_bias)))
    if block.offsets is not None:
        total = b.fadd(total, e.fold8(b.fmul(block.offsets, sums)))
    return total


def _k_int8_dot(e, block, xq, xd, xs, total):
    """IR: `total` (<8 x float>, <16 x float> with AVX-512) plus lanes that sum to the dot of
    an unpacked K-quant block with a Q8_K activation block: 256 int8 levels at xq, one
    float32 scale at xd, the scaled sums of each 16 levels at xs. Sub-block products stay
    integer to the end of the block; with AVX-512 two sub-blocks are multiplied at a time."""
    b, width = e.b, e.multiply_bytes
    per, lanes = width // 32, width // 4  # sub-blocks per multiply, int32 lanes of the sum
    acc = e.const(_I32, lanes, 0)
    for c in range(len(block.levels) // per):
        levels = block.levels[per * c]
        if per == 2:
            levels = e.shuffle(levels, block.levels[per * c + 1], range(64))
        scales = e.pick(block.int_scales, [(c * width // 2 + m) // block.pairs_per_scale for m in range(width // 2)])
        acc = e.add_pair_products(acc, e.pair_products(levels, e.load(xq, width * c, _I8, width)), scales)
    sums = e.load(xs, 0, _F32, 16)
    if lanes == 8:
        total = e.fma(e.pick(block.offsets16, range(8)), e.pick(sums, range(8)), total)
        total = e.fma(e.pick(block.offsets16, range(8, 16)), e.pick(sums, range(8, 16)), total)
    else:
        total = e.fma(block.offsets16, sums, total)
    # (acc * d) * xd rather than acc * (d * xd): a vector multiply by the block's d, which
    # all activations share, and xd broadcast from memory into the FMA
    return e.fma(b.fmul(e.to_float(acc), e.splat(block.d, lanes), flags=_FAST), e.splat(e.load(xd, 0, _F32), lanes), total)


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
    k_quant = DOT_TYPES[encoding] == "Q8_K"
    # bytes per block of an activation's int8 values, scales and sums (per 16)
    strides = (weights, weights // ACT_BLOCKS[DOT_TYPES[encoding]] * 4, weights // 16 * 4)
    dot = _k_int8_dot if k_quant else _int8_dot

    def codegen(context, builder, sig, args):
        e = _Emitter(context, builder)
        start, nblocks = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3))
        bases = [e.pointer(sig.args[i], args[i]) for i in (4, 5, 6)]
        row_bytes = [builder.mul(nblocks, ir.Constant(_I64, stride)) for stride in strides]
        lanes = e.multiply_bytes // 4 if k_quant else 8  # of the vector a block's dot returns
        totals = [cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, lanes), [0.0] * lanes)) for _ in range(count)]

        def body(index, block):
            for k, total in enumerate(totals):
                q, d, s = (e.at(base, builder.add(builder.mul(ir.Constant(_I64, k), size),
                                                  builder.mul(index, ir.Constant(_I64, stride))))
                           for base, size, stride in zip(bases, row_bytes, strides))
                builder.store(dot(e, block, q, d, s, builder.load(total)), total)

        _block_loop(e, encoding, e.pointer(sig.args[1], args[1], start), nblocks, body)
        dots = [e.hsum(e.fold8(builder.load(total))) for total in totals]
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
        if _act_dot_type(act) is not None:
            if _act_dot_type(act) != DOT_TYPES[encoding]:
                return None
            return lambda tag, w, offset, cols, act: _row_dot_int8(tag, w, offset, cols // weights, act.q, act.d, act.sums)
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


def _rows_times(tag, w, first, stop, row_nbytes, cols, act, out, buf):
    """out[:, first:stop] = rows first..stop-1 of `w` times each of the n activations `act`
    (float32 [n, cols], or an int8 activation of [n, ...] arrays)."""


@overload(_rows_times)
def _rows_times_overload(tag, w, first, stop, row_nbytes, cols, act, out, buf):
    encoding = _encoding_of(tag)
    if encoding is None:
        return None
    weights, nbytes = block_size(encoding)
    if _act_dot_type(act) is not None:
        if _act_dot_type(act) != DOT_TYPES[encoding]:
            return None

        def int8_impl(tag, w, first, stop, row_nbytes, cols, act, out, buf):
            q, d, s = act
            n, nblocks = out.shape[0], cols // weights
            grouped = n - n % GROUP
            half = n - grouped >= GROUP // 2
            # A tile of rows stays in L2 while each group of activations, in L1, passes over it.
            for tile in range(first, stop, ROW_TILE):
                end = min(tile + ROW_TILE, stop)
                for i in range(0, grouped, GROUP):  # each block unpacked once for GROUP activations
                    for r in range(tile, end):
                        dots = _row_dots_int8(tag, w, r * row_nbytes, nblocks, q[i:], d[i:], s[i:])
                        for k in range(GROUP):
                            out[i + k, r] = dots[k]
                if half:
                    for r in range(tile, end):
                        dots = _row_dots_int8_half(tag, w, r * row_nbytes, nblocks, q[grouped:], d[grouped:],
                                                   s[grouped:])
                        for k in range(GROUP // 2):
                            out[grouped + k, r] = dots[k]
                for i in range(grouped + half * (GROUP // 2), n):
                    for r in range(tile, end):
                        out[i, r] = _row_dot_int8(tag, w, r * row_nbytes, nblocks, q[i], d[i], s[i])
        return int8_impl

    def float_impl(tag, w, first, stop, row_nbytes, cols, act, out, buf):
        for r in range(first, stop):
            offset = r * row_nbytes
            if out.shape[0] == 1:
                out[0, r] = _row_dot(tag, w, offset, cols, act[0])
                continue
            out[:, r] = 0.0
            for start in range(0, cols, CHUNK):  # each chunk is dequantized once for all n
                count = min(CHUNK, cols - start)
                _dequantize_into(tag, w, offset + start // weights * nbytes, count, buf)
                for i in range(out.shape[0]):
                    out[i, r] += _dot(buf, act[i, start:], count)
    return float_impl


def _act_row(act, i):
    """Activation i of a batch (a row of a float32 matrix, or of each int8 activation array)."""


@overload(_act_row)
def _act_row_overload(act, i):
    if _act_dot_type(act) is not None:
        activation = act.instance_class
        return lambda act, i: activation(act.q[i], act.d[i], act.sums[i])
    return lambda act, i: act[i]


# ------------------------------------------------------------------ int8 activations


@_njit
def _abs_max(values):
    """max |values| (contiguous float32): an integer max over the bits without the sign, which
    orders as the floats do, and which LLVM vectorizes (a float max it does not)."""
    bits = values.view(np.int32)
    top = np.int32(0)
    for i in range(bits.size):  # indices from 0: no negative-index checks, vectorized
        top = max(top, bits[i] & np.int32(0x7FFFFFFF))
    return _int_bits_to_float(top)


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_blocks(values, q, d, sums, start, stop, block):
    """Quantize values[start:stop] (whole blocks of `block`) to int8: levels q, one scale d per
    block, and the sum of the levels of each 16 times its block's scale (`sums`)."""
    for b in range(start // block, stop // block):
        x, levels = values[b * block:(b + 1) * block], q[b * block:(b + 1) * block]
        amax = _abs_max(x)
        d[b] = amax / F32(127.0)
        inverse = F32(127.0) / amax if amax > 0 else F32(0.0)
        for i in range(block):
            levels[i] = np.int8(np.rint(x[i] * inverse))
        for group in range(block // 16):
            total = np.int32(0)
            for i in range(16):
                total += levels[16 * group + i]
            sums[b * block // 16 + group] = d[b] * F32(total)


def _empty_activation(n, cols, dot_type):
    """Uninitialized int8 activations of n rows of `cols` values in `dot_type`."""
    return ACTIVATIONS[dot_type](np.empty((n, cols), np.int8), np.empty((n, cols // ACT_BLOCKS[dot_type]), np.float32),
                                 np.empty((n, cols // 16), np.float32))


def _act_dot_type(act) -> str | None:
    """The dot type of a numba activation type ("Q8_0", "Q8_K"), None for float32 arrays."""
    if isinstance(act, types.BaseNamedTuple):
        for dot_type, activation in ACTIVATIONS.items():
            if act.instance_class is activation:
                return dot_type
    return None


def _finish_activation(act, values, start, stop):
    """Make values.flat[start:stop] usable as `act`: quantize it into an int8 tuple, or
    nothing when `act` is `values` itself (float path)."""


@overload(_finish_activation)
def _finish_activation_overload(act, values, start, stop):
    if _act_dot_type(act) is not None:
        block = ACT_BLOCKS[_act_dot_type(act)]

        def quantize(act, values, start, stop):
            q, d, sums = act
            _quantize_blocks(values.reshape(-1), q.reshape(-1), d.reshape(-1), sums.reshape(-1), start, stop, block)
        return quantize
    return lambda act, values, start, stop: None


@_njit
def _quantize_all(act, values):
    _finish_activation(act, values, 0, values.size)
    return act


# ------------------------------------------------------------------ parallel kernels


@_njit
def _share(count, parts, part, align):
    """Rows [first, stop) of `part` when `count` rows are cut into `parts` contiguous ranges
    whose bounds are multiples of `align`."""
    units = (count + align - 1) // align
    return min(count, units * part // parts * align), min(count, units * (part + 1) // parts * align)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _exp_nonpositive(x):
    """exp(x) for x <= 0 to 4e-6 relative (x clamped at -87), without a libm call, so that a
    loop of them vectorizes: 2**(x log2 e) as 2**floor times a degree-8 Taylor polynomial of
    the fraction."""
    t = max(x, F32(-87.0)) * F32(1.4426950408889634)
    whole = np.floor(t)
    f = (t - whole) * F32(0.6931471805599453)
    p = F32(1.0 / 40320.0)
    for c in (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * f + F32(c)
    return p * _int_bits_to_float((np.int32(whole) + np.int32(127)) << np.int32(23))


@njit(cache=True, nogil=True, fastmath=True)
def _softmax_in_place(scores, i, end):
    """scores[i, :end] (float32) <- their softmax, with `_exp_nonpositive`. Not inlined: inlined
    into the decode attention's parallel loop, it took away the second thread's gain."""
    best = F32(-3.0e38)
    for pos in range(end):
        best = max(best, scores[i, pos])
    total = F32(0.0)
    for pos in range(end):
        scores[i, pos] = _exp_nonpositive(scores[i, pos] - best)
        total += scores[i, pos]
    inverse = F32(1.0) / total
    for pos in range(end):
        scores[i, pos] *= inverse


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _silu(v):
    """v * sigmoid(v), from exp(-|v|): no overflow, and a loop of them vectorizes."""
    e = _exp_nonpositive(-abs(v))
    return v * (F32(1.0) if v >= 0 else e) / (F32(1.0) + e)


@_parallel
def _matmul_kernel(tag, w, rows, cols, row_nbytes, act, out, nthreads):
    for t in prange(nthreads):
        first, stop = _share(rows, nthreads, t, 1)
        _rows_times(tag, w, first, stop, row_nbytes, cols, act, out, np.empty(CHUNK, np.float32))


@_parallel
def _tile_matmul_kernel(tag, w, rows, cols, row_nbytes, packed, out, nthreads):
    """out [n, rows] = the rows of `w` times the packed bfloat16 activations, with AMX tiles
    (`runtime/amx.py`): each thread dequantizes blocks of 32 rows to bfloat16 once and passes
    every token over them."""
    blocks = (rows + amx.BLOCK - 1) // amx.BLOCK
    config = amx.tile_config()
    for t in prange(nthreads):
        values = np.empty(cols, np.float32)
        weights = np.zeros((amx.BLOCK, cols + amx.ROW_PAD), np.uint16)
        sums = np.empty((amx.BLOCK, packed.shape[0] * 16), np.float32)
        amx.start(config)
        first, stop = _share(blocks, nthreads, t, 1)
        for block in range(first, stop):
            top = block * amx.BLOCK
            count = min(amx.BLOCK, rows - top)
            for r in range(count):
                _dequantize_into(tag, w, (top + r) * row_nbytes, cols, values)
                amx.round_row(values, weights[r])
            amx.block_product(weights, packed, sums)
            for i in range(out.shape[0]):
                for r in range(count):
                    out[i, top + r] = sums[r, i]
        amx.finish()


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
    #    thread then quantizes its own (256-aligned) part of h for the down projection.
    for t in prange(nthreads):
        first, stop = _share(k * ffn, nthreads, t, WIDEST_ACT_BLOCK)
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


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _silu_times(gate, up, nthreads):
    """gate <- silu(gate) * up, elementwise ([n, ffn] each)."""
    for t in prange(nthreads):
        first, stop = _share(gate.shape[0], nthreads, t, 1)
        for i in range(first, stop):
            g, u = gate[i], up[i]
            for j in range(g.size):
                g[j] = _silu(g[j]) * u[j]
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
    """Each thread takes (query, kv head) pairs and does the query heads that share the kv
    head together: each cached key and value is converted to float32 once for all of them."""
    n, heads, width = q.shape
    kv_heads, v_width = keys.shape[1], values.shape[2]
    group = heads // kv_heads
    for t in prange(nthreads):
        first, stop = _share(n * kv_heads, nthreads, t, 1)
        scores = np.empty((group, start + n), np.float32)
        key, value = np.empty(width, np.float32), np.empty(v_width, np.float32)
        for work in range(first, stop):
            i, kv = work // kv_heads, work % kv_heads
            end, h0 = start + i + 1, kv * group  # causal: query i sees positions 0..start+i
            for pos in range(end):
                for d in range(width):
                    key[d] = _as_f32(keys[pos, kv, d])
                for g in range(group):
                    score = F32(0.0)
                    for d in range(width):
                        score += q[i, h0 + g, d] * key[d]
                    scores[g, pos] = score * scale
            for g in range(group):
                _softmax_in_place(scores, g, end)
                out[i, h0 + g, :] = 0.0
            for pos in range(end):
                for d in range(v_width):
                    value[d] = _as_f32(values[pos, kv, d])
                for g in range(group):
                    weight = scores[g, pos]
                    for d in range(v_width):
                        out[i, h0 + g, d] += weight * value[d]


# A decode step's attention is too small to pay for waking the threads; long contexts and
# prompts are not.
_attention_serial = njit(cache=True, nogil=True, fastmath=True)(_attention_loops)
_attention_parallel = njit(cache=True, nogil=True, parallel=True, fastmath=True)(_attention_loops)
PARALLEL_ATTENTION_WORK = 1 << 20  # multiply-adds from which attention runs on all threads
PROMPT_ATTENTION_QUERIES = 32  # queries from which attention converts the cache once (a prompt) ...
PROMPT_ATTENTION_BYTES = 32 << 20  # ... when the float32 copy of the cache takes at most this
QUERY_BLOCK = 16  # queries of one head whose scores a thread computes together


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _prompt_attention(q, keys, values, start, scale, out, nthreads):
    """`attention` for many queries. The cache is converted to float32 once (keys transposed,
    [kv head, width, position]); then each thread takes blocks of QUERY_BLOCK queries of one
    head, accumulates their scores one key dimension at a time (a vector of positions per
    multiply, no horizontal sums) and their outputs one position at a time."""
    n, heads, width = q.shape
    kv_heads, v_width, end = keys.shape[1], values.shape[2], start + n
    group = heads // kv_heads
    keys_t = np.empty((kv_heads, width, end), np.float32)
    values_f = np.empty((kv_heads, end, v_width), np.float32)
    for t in prange(nthreads):
        lo, hi = _share(end, nthreads, t, 1)
        for pos in range(lo, hi):
            for kv in range(kv_heads):
                for d in range(width):
                    keys_t[kv, d, pos] = _as_f32(keys[pos, kv, d])
                for d in range(v_width):
                    values_f[kv, pos, d] = _as_f32(values[pos, kv, d])
    blocks = (n + QUERY_BLOCK - 1) // QUERY_BLOCK
    for t in prange(nthreads):
        lo, hi = _share(blocks * heads, nthreads, t, 1)
        scores = np.empty((QUERY_BLOCK, end), np.float32)
        outputs = np.empty((QUERY_BLOCK, v_width), np.float32)
        for work in range(lo, hi):
            first, h = work // heads * QUERY_BLOCK, work % heads
            kv, count = h // group, min(QUERY_BLOCK, n - first)
            seen = start + first  # positions every query of the block sees; query i sees seen + i + 1
            for i in range(count):
                scores[i, :seen + i + 1] = 0.0
            for d in range(width):
                column = keys_t[kv, d]
                for i in range(count):
                    row, weight = scores[i], q[first + i, h, d] * scale
                    for pos in range(seen + i + 1):
                        row[pos] += weight * column[pos]
            for i in range(count):
                _softmax_in_place(scores, i, seen + i + 1)
            outputs[:count] = 0.0
            for pos in range(seen + count):
                value = values_f[kv, pos]
                for i in range(max(0, pos - seen), count):
                    weight, result = scores[i, pos], outputs[i]
                    for d in range(v_width):
                        result[d] += weight * value[d]
            for i in range(count):
                out[first + i, h, :] = outputs[i]


@njit(cache=True, nogil=True, fastmath=True)
def _rms_norm_kernel(x, weight, eps, out):
    for i in range(x.shape[0]):
        total = F32(0.0)
        for j in range(x.shape[1]):
            total += x[i, j] * x[i, j]
        inverse = F32(1.0) / np.sqrt(total / F32(x.shape[1]) + eps)
        for j in range(x.shape[1]):
            out[i, j] = x[i, j] * inverse * weight[j]


@_njit
def _route_rows(logits, bias, sigmoid, groups, topk_groups, top2_sum, norm, scale, ids, weights):
    n, experts = logits.shape
    k, per_group = ids.shape[1], experts // groups
    scores, choice = np.empty(experts, np.float32), np.empty(experts, np.float32)
    group_scores = np.empty(groups, np.float32)
    for i in range(n):
        row = logits[i]
        if sigmoid:
            for e in range(experts):
                scores[e] = F32(1.0) / (F32(1.0) + np.exp(-row[e]))
        else:
            top, total = row.max(), F32(0.0)
            for e in range(experts):
                scores[e] = np.exp(row[e] - top)
                total += scores[e]
            for e in range(experts):
                scores[e] = scores[e] / total
        for e in range(experts):
            choice[e] = scores[e] + bias[e]
        if groups > 1:
            for g in range(groups):
                part = choice[g * per_group:(g + 1) * per_group]
                first = np.argmax(part)
                if top2_sum:
                    second = F32(-np.inf) if per_group > 1 else F32(0.0)
                    for e in range(per_group):
                        if e != first and part[e] > second:
                            second = part[e]
                    group_scores[g] = second + part[first]
                else:
                    group_scores[g] = part[first]
            for _ in range(topk_groups):  # the kept groups' scores become +inf
                group_scores[np.argmax(np.where(group_scores == np.inf, -np.inf, group_scores))] = np.inf
            for g in range(groups):
                if group_scores[g] != np.inf:
                    choice[g * per_group:(g + 1) * per_group] = -np.inf
        total = F32(0.0)
        for j in range(k):  # the highest choice first; of equal ones, the lowest id
            e = np.argmax(choice)
            ids[i, j], weights[i, j] = e, scores[e]
            choice[e] = -np.inf
            total += scores[e]
        for j in range(k):
            if norm:
                weights[i, j] = weights[i, j] / (total + (F32(1e-20) if sigmoid else F32(0.0)))
            weights[i, j] = weights[i, j] * scale


def route(logits: np.ndarray, bias: np.ndarray | None, k: int, sigmoid: bool = False, groups: int = 1,
          topk_groups: int = 1, top2_sum: bool = True, norm: bool = False, scale: float = 1.0):
    """The k experts each row of router logits [n, experts] picks -> (ids int64 [n, k],
    weights float32 [n, k]). Scores are the softmax or the sigmoid of the logits; the choice
    adds `bias` (DeepSeek-V3's correction) and, with `groups` > 1, keeps only the experts of
    the `topk_groups` groups that score best (sum of their top two choices, or the max);
    weights are the chosen scores, renormalized to sum 1 when `norm`, times `scale`."""
    n, experts = logits.shape
    ids, weights = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
    bias = np.zeros(experts, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    _route_rows(np.ascontiguousarray(logits, dtype=np.float32), bias, sigmoid, groups, topk_groups, top2_sum, norm,
                F32(scale), ids, weights)
    return ids, weights


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


def _dot_type(encoding: str, exact: bool) -> str | None:
    """The int8 activation format `encoding` weights are multiplied with, or None for float32
    activations (the exact path, and float weights)."""
    return None if exact else DOT_TYPES.get(encoding)


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


def _activation(x: np.ndarray, dot_type: str | None, tiles: bool = True):
    """float32 [n, cols] as the kernels take it: x itself (None: the exact path); rounded to
    bfloat16 for AMX tiles when `tiles`, there are at least amx.MIN_TOKENS rows and the CPU
    has them; else quantized to int8 `dot_type` activations."""
    if dot_type is None:
        return x
    if tiles and x.shape[0] >= amx.MIN_TOKENS and amx.available():
        return amx.TileActivation(x)
    return _quantize_all(_empty_activation(*x.shape, dot_type), x)


def _product(tag, w: np.ndarray, rows: int, cols: int, row_nbytes: int, act, n: int) -> np.ndarray:
    """The [rows, cols] matrix at the start of `w` times an activation from `_activation` of
    n rows -> float32 [n, rows]."""
    out = np.empty((n, rows), np.float32)
    if isinstance(act, amx.TileActivation):
        _tile_matmul_kernel(tag, w, rows, cols, row_nbytes, act.packed, out, numba.get_num_threads())
    else:
        _matmul_kernel(tag, w, rows, cols, row_nbytes, act, out, numba.get_num_threads())
    return out


def _take(act, index):
    """Rows `index` of a batch of activations (an int: one activation, its vector or vectors)."""
    if isinstance(act, amx.TileActivation):
        return act.take(index)
    return act[index] if isinstance(act, np.ndarray) else type(act)(*(a[index] for a in act))


class Matrix:
    """A [rows, cols] weight matrix in its stored encoding, checked once and then multiplied
    many times: the per-call work of a decode step is one activation and one kernel call."""

    def __init__(self, w: np.ndarray, encoding: str, rows: int, cols: int, exact: bool = False):
        self.data, self.row_nbytes = _weights(w, encoding, rows, cols)
        self.encoding, self.rows, self.cols = encoding, rows, cols
        self.tag = BLOCK_TAGS[encoding]
        self.dot_type = _dot_type(encoding, exact)

    def activation(self, x: np.ndarray, tiles: bool = True):
        """x float32 [n, cols] as this matrix's kernel takes it (on AMX tiles for a prompt,
        unless not `tiles`); share it between matrices of the same `dot_type` that multiply
        the same x."""
        return _activation(_float_rows(x, self.cols), self.dot_type, tiles)

    def empty_activation(self, n: int):
        """An unfilled int8 activation of n rows for this matrix's kernels (fast path only)."""
        return _empty_activation(n, self.cols, self.dot_type)

    def times(self, act, n: int) -> np.ndarray:
        """The product with an activation from `activation` of n rows -> float32 [n, rows]."""
        return _product(self.tag, self.data, self.rows, self.cols, self.row_nbytes, act, n)

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
        act = self.activation(x, tiles=False)
        _per_head_kernel(self.tag, self.data, self.cols, self.row_nbytes, act, heads, stride, first, out,
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
    copy_bytes = 4 * (start + n) * (keys.shape[1] * width + values.shape[1] * values.shape[2])
    if n >= PROMPT_ATTENTION_QUERIES and copy_bytes <= PROMPT_ATTENTION_BYTES:
        _prompt_attention(q, keys, values, start, F32(scale), out, numba.get_num_threads())
    elif work >= PARALLEL_ATTENTION_WORK:
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
        self.dot_types = tuple(_dot_type(encoding, exact) for encoding in encodings)

    def activations(self, x: np.ndarray) -> dict:
        """x float32 [n, hidden] as the gate and the up kernels take it (by dot type: quantized
        once when they share one), for `batch`; quantize a layer's tokens once for all its experts."""
        return {dot_type: _activation(x, dot_type) for dot_type in set(self.dot_types[:2])}

    @staticmethod
    def rows_of(acts: dict, rows: np.ndarray) -> dict:
        """The activations of tokens `rows` (an index array) of `activations`' result."""
        return {dot_type: _take(act, rows) for dot_type, act in acts.items()}

    def __call__(self, records: np.ndarray, slots: np.ndarray, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """records uint8 [m, >= record_bytes] (C-contiguous, e.g. a cache slab used in place),
        slots int64 [k] (the experts' rows), x float32 [hidden], weights float32 [k] -> float32 [hidden]."""
        k, ffn = slots.shape[0], self.ffn
        acts = self.activations(x.reshape(1, self.hidden))
        gate_act, up_act = (_take(acts[dot_type], 0) for dot_type in self.dot_types[:2])
        h = np.empty((k, ffn), np.float32)
        h_act = h if self.dot_types[2] is None else _empty_activation(k, ffn, self.dot_types[2])
        out = np.empty(self.hidden, np.float32)
        _moe_kernel(*self.tags, records, slots, self.offsets, self.sizes, ffn, self.hidden, gate_act, up_act, h, h_act,
                    weights, out, numba.get_num_threads())
        return out

    def batch(self, record: np.ndarray, acts: dict, n: int) -> np.ndarray:
        """One expert (its record, contiguous uint8 [>= record_bytes]) applied to each of n
        tokens, given as `activations` of them -> float32 [n, hidden], without a routing
        weight (prefill)."""
        gate, up = (self._project(record, m, self.ffn, self.hidden, acts[dot_type], n)
                    for m, dot_type in enumerate(self.dot_types[:2]))
        h = _silu_times(gate, up, numba.get_num_threads())
        return self._project(record, 2, self.hidden, self.ffn, _activation(h, self.dot_types[2]), n)

    def _project(self, record: np.ndarray, m: int, rows: int, cols: int, act, n: int) -> np.ndarray:
        return _product(self.tags[m], record[self.offsets[m]:], rows, cols, self.sizes[m], act, n)


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
    kernel = ExpertKernel(record.size, encodings, offsets, ffn, hidden, exact)
    return kernel.batch(record, kernel.activations(_float_rows(x, hidden)), x.shape[0])


@_njit
def add_weighted_rows(out: np.ndarray, rows: np.ndarray, y: np.ndarray, weights: np.ndarray) -> None:
    """out[rows[i]] += weights[i] * y[i] for each i (rows distinct): an expert's outputs
    added to its tokens' sums."""
    for i in range(rows.size):
        target, source, weight = out[rows[i]], y[i], weights[i]
        for j in range(source.size):
            target[j] += weight * source[j]


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

