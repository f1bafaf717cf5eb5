"""LLVM IR building blocks of the kernels' intrinsics: the `Emitter` and scalar conversions.

`Emitter` wraps a numba IR builder with the vector operations the block unpackers and dot
products are written in (`blocks.py`, `rows.py`): AVX-512, AVX-VNNI or AVX2 instructions where
the CPU numba compiles for has them, portable vector IR otherwise. The `@intrinsic`s give
compiled code what needs bit-level IR: half and bfloat16 to float32, integer bits to float32,
and a cache-line prefetch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import llvmlite.binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# `Emitter.add_pair_products` emits vpdpwssd as inline assembly, which LLVM parses
llvmlite.binding.initialize_native_asmparser()

I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
FLOAT, _HALF = ir.FloatType(), ir.HalfType()
_BYTE_PTR = I8.as_pointer()
CONTRACT = ("contract",)  # lets LLVM fuse a multiply and an add into an FMA


def vec(element, n):
    return ir.VectorType(element, n)


@dataclass(frozen=True)
class Isa:
    """What the target numba compiles for offers the kernels, from LLVM's (triple, cpu, features)."""

    cpu: str
    x86: bool
    avx2: bool
    vnni: bool  # vpdpbusd on 32 bytes (AVX-VNNI, or AVX-512 VNNI with VL)
    avx512: bool  # 64-byte integer multiplies (AVX-512 BW)
    vnni512: bool
    f16c: bool

    @classmethod
    def of(cls, magic_tuple) -> "Isa":
        triple, cpu, features = magic_tuple
        enabled = {f[1:] for f in features.split(",") if f.startswith("+")}
        x86 = triple.startswith(("x86_64", "i386", "i686"))
        avx2, avx512 = x86 and "avx2" in enabled, x86 and "avx512bw" in enabled
        return cls(cpu, x86, avx2, avx2 and ("avxvnni" in enabled or {"avx512vnni", "avx512vl"} <= enabled), avx512,
                   avx512 and "avx512vnni" in enabled, x86 and "f16c" in enabled)

    def paths(self) -> dict:
        """The instructions each kernel path uses on this target, for reports."""
        k_quant = ("vpmaddubsw + vpdpwssd, 64 bytes" if self.vnni512 else "vpmaddubsw + vpmaddwd, 64 bytes" if self.avx512
                   else "vpmaddubsw + vpdpwssd, 32 bytes" if self.vnni else "vpmaddubsw + vpmaddwd, 32 bytes" if self.avx2
                   else "portable vector IR")
        q8_0 = "vpdpbusd" if self.vnni else "vpmaddubsw + vpmaddwd" if self.avx2 else "portable vector IR"
        return {"cpu": self.cpu, "k_quant_dot": k_quant, "q8_0_dot": q8_0,
                "table_lookup": "vpshufb" if self.avx2 else "selects", "half_to_float": "vcvtph2ps" if self.f16c else "integer"}


# Targets other than this CPU, as numba environment variables (numba takes NUMBA_CPU_NAME's
# scheduling model but keeps the host's features unless NUMBA_CPU_FEATURES says otherwise):
# "avx2" is this CPU without AVX-512, AMX, AVX-VNNI or GFNI (an AMD Zen 2/3: LLVM would otherwise
# shift bytes with GFNI's vgf2p8affineqb, which those lack), "avx2-vnni" keeps AVX-VNNI and the host's GFNI
# (Intel Alder Lake), "generic" has no AVX at all.
TARGET_CPUS = {"avx2": "haswell", "avx2-vnni": "alderlake", "generic": "generic"}
_WIDE = ("avx512", "amx", "avx10", "avxvnni", "avxifma", "avxneconvert", "avxvnniint")
_DROPPED = {"avx2": (*_WIDE, "gfni"), "avx2-vnni": _WIDE}
_ADDED = {"avx2": (), "avx2-vnni": ("avxvnni",)}


def target_environment(target: str) -> dict[str, str]:
    """NUMBA_CPU_NAME and NUMBA_CPU_FEATURES that make numba compile for `target`."""
    if target == "generic":
        return {"NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": ""}
    host = llvmlite.binding.get_host_cpu_features().flatten().split(",")
    added = _ADDED[target]
    features = [f"-{f[1:]}" if f[1:].startswith(_DROPPED[target]) else f for f in host if f[1:] not in added]
    features += [f"+{name}" for name in added]
    return {"NUMBA_CPU_NAME": TARGET_CPUS[target], "NUMBA_CPU_FEATURES": ",".join(features)}


def restart_for(target: str) -> None:
    """Run this program again compiling for `target` ("native": go on as it is), unless it
    already does: numba reads its target when it first compiles."""
    if target != "native" and os.environ.get("NUMBA_CPU_NAME") != TARGET_CPUS[target]:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **target_environment(target)})


def target_isa() -> Isa:
    """The Isa of the target numba compiles for in this process (NUMBA_CPU_NAME, or this CPU)."""
    from numba.core.registry import cpu_target

    return Isa.of(cpu_target.target_context.codegen().magic_tuple())


class Emitter:
    """LLVM IR building blocks for the CPU numba compiles for: AVX-512, AVX-VNNI or AVX2 dot
    products and F16C conversions where the target has them, portable IR otherwise."""

    def __init__(self, context, builder):
        self.context, self.b = context, builder
        isa = Isa.of(context.codegen().magic_tuple())
        self.avx2, self.vnni, self.avx512, self.vnni512, self.f16c = isa.avx2, isa.vnni, isa.avx512, isa.vnni512, isa.f16c
        self.x86 = isa.x86
        self.multiply_bytes = 64 if self.avx512 else 32  # bytes per vector of `pair_products`
        # K-quant blocks multiplied as one integer (`blocks.INTEGER_TOTALS`), where prompts take
        # the int8 tiles; the dots of lane activations turn it off (`rows.py`)
        self.int_totals = self.vnni512

    # memory
    def pointer(self, arraytype, array, byte_offset=None):
        """i8* to an array's data, `byte_offset` (an int64 IR value) bytes in."""
        data = self.context.make_array(arraytype)(self.context, self.b, array).data
        data = self.b.bitcast(data, _BYTE_PTR)
        return data if byte_offset is None else self.b.gep(data, [byte_offset])

    def at(self, base, offset):
        return self.b.gep(base, [offset if isinstance(offset, ir.Value) else ir.Constant(I64, offset)])

    def load(self, base, offset, element, n=None):
        kind = element if n is None else vec(element, n)
        return self.b.load(self.b.bitcast(self.at(base, offset), kind.as_pointer()), align=1)

    def lanes(self, vector):
        """The lanes of an integer vector as IR scalars, read back from a stack slot that the
        compiler cannot see through: a load each, where LLVM would extract each lane with a
        shuffle-port instruction (vpextrw) that the unpackers' shuffles also need."""
        slot = cgutils.alloca_once(self.b, vector.type)
        self.b.store(vector, slot)
        opaque = self.b.asm(ir.FunctionType(slot.type, [slot.type]), "", "=r,0,~{memory}", [slot], True)
        element = vector.type.element
        base = self.b.bitcast(opaque, _BYTE_PTR)
        return [self.load(base, k * element.width // 8, element) for k in range(vector.type.count)]

    def prefetch(self, address):
        fn = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(ir.VoidType(), [_BYTE_PTR, I32, I32, I32]), "llvm.prefetch.p0")
        self.b.call(fn, [address, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])

    def half(self, base, offset):
        return self.half_to_float(self.load(base, offset, I16))

    def half_to_float(self, bits):
        """float32 of IEEE half bits (an i16); exact for every finite half."""
        b = self.b
        if self.f16c:
            # vmovd + vcvtph2ps as inline assembly: for a scalar half LLVM emits vpinsrw into
            # whatever register is free, often a loop's accumulator, and that false dependency
            # chains the iterations (a 32-weight block's int8 dot ran 3x slower)
            converted = b.asm(ir.FunctionType(vec(FLOAT, 4), [I32]), "vmovd $1, $0\n\tvcvtph2ps $0, $0", "=x,r",
                              [b.zext(bits, I32)], False)
            return b.extract_element(converted, ir.Constant(I32, 0))
        if not self.x86:  # other CPUs convert halves natively
            return b.fpext(b.bitcast(bits, _HALF), FLOAT)
        return self._halves_by_integer_steps(bits, I32, FLOAT)

    def halves_to_floats(self, bits):
        """<n x float> of a vector of IEEE half bits (<n x i16>): vcvtph2ps with F16C, else
        the integer steps of `half_to_float` on every lane; exact for every finite half."""
        b, n = self.b, bits.type.count
        if self.f16c or not self.x86:
            return b.fpext(b.bitcast(bits, vec(_HALF, n)), vec(FLOAT, n))
        return self._halves_by_integer_steps(bits, vec(I32, n), vec(FLOAT, n))

    def _halves_by_integer_steps(self, bits, ints, floats):
        """float32 of half bits (`ints` and `floats` the i32 and float types of a scalar or a
        vector of them) without F16C, where LLVM would call a runtime function numba does not
        provide: the exponent and mantissa moved into float32 position, the exponent rescaled
        by 2**112."""
        b = self.b

        def constant(kind, value):  # a scalar, or one value in every lane
            return ir.Constant(kind, [value] * kind.count if isinstance(kind, ir.VectorType) else value)

        wide = b.zext(bits, ints)
        magnitude = b.bitcast(b.shl(b.and_(wide, constant(ints, 0x7FFF)), constant(ints, 13)), floats)
        magnitude = b.bitcast(b.fmul(magnitude, constant(floats, 2.0**112)), ints)
        sign = b.shl(b.and_(wide, constant(ints, 0x8000)), constant(ints, 16))
        return b.bitcast(b.or_(magnitude, sign), floats)

    def call(self, name, result, *args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(result, [a.type for a in args]), name)
        return self.b.call(fn, args)

    # vectors
    @staticmethod
    def const(element, n, value):
        return ir.Constant(vec(element, n), [ir.Constant(element, value)] * n)

    def shuffle(self, a, b, lanes):
        return self.b.shuffle_vector(a, b, ir.Constant(vec(I32, len(lanes)), list(lanes)))

    def pick(self, vector, lanes):
        return self.shuffle(vector, ir.Constant(vector.type, None), lanes)

    def splat(self, scalar, n=8):
        one = self.b.insert_element(ir.Constant(vec(scalar.type, 1), None), scalar, ir.Constant(I32, 0))
        return self.pick(one, [0] * n)

    def fma(self, a, b, c):
        return self.b.fadd(self.b.fmul(a, b, flags=CONTRACT), c, flags=CONTRACT)

    def weighted_sum(self, terms):
        """Sum of a * b over (a, b) vector pairs: a multiply and an FMA per two pairs, then a
        tree of adds, so that no long chain of dependent FMAs limits the loop."""
        sums = []
        for i in range(0, len(terms), 2):
            total = self.b.fmul(*terms[i], flags=CONTRACT)
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
        return self.b.sitofp(ints, vec(FLOAT, ints.type.count))

    def hsum(self, v8):
        b = self.b
        v4 = b.fadd(self.pick(v8, range(4)), self.pick(v8, range(4, 8)))
        v2 = b.fadd(self.pick(v4, range(2)), self.pick(v4, range(2, 4)))
        return b.fadd(b.extract_element(v2, ir.Constant(I32, 0)), b.extract_element(v2, ir.Constant(I32, 1)))

    def _sum_quads(self, products):
        """<32 x i32> -> <8 x i32>, lane m = products[4m] + ... + products[4m + 3]."""
        sums = [self.pick(products, range(k, 32, 4)) for k in range(4)]
        return self.b.add(self.b.add(sums[0], sums[1]), self.b.add(sums[2], sums[3]))

    def dot_u8s8(self, unsigned, signed):
        """<8 x i32>, lane m = sum of unsigned[j] * signed[j] over bytes j = 4m..4m+3.
        Callers keep every pair sum within int16 (vpmaddubsw saturates)."""
        b = self.b
        if self.vnni:
            as_i32 = vec(I32, 8)
            return self.call("llvm.x86.avx512.vpdpbusd.256", as_i32, self.const(I32, 8, 0),
                             b.bitcast(unsigned, as_i32), b.bitcast(signed, as_i32))
        if self.avx2:
            return self.add_pair_products(self.const(I32, 8, 0), self.pair_products(unsigned, signed),
                                          self.const(I16, 16, 1))
        wide = vec(I32, 32)
        return self._sum_quads(b.mul(b.zext(unsigned, wide), b.sext(signed, wide)))

    def pair_products(self, unsigned, signed):
        """<n/2 x i16>, lane m = unsigned[2m] * signed[2m] + unsigned[2m + 1] * signed[2m + 1]
        (n = 32 bytes, or 64 with AVX-512). Callers keep every pair sum within int16
        (vpmaddubsw saturates)."""
        n = unsigned.type.count
        if self.avx2 and n == 32 or self.avx512 and n == 64:
            name = "llvm.x86.avx2.pmadd.ub.sw" if n == 32 else "llvm.x86.avx512.pmaddubs.w.512"
            return self.call(name, vec(I16, n // 2), unsigned, signed)
        b, wide = self.b, vec(I16, n)
        products = b.mul(b.zext(unsigned, wide), b.sext(signed, wide))
        return b.add(self.pick(products, range(0, n, 2)), self.pick(products, range(1, n, 2)))

    def pinned(self, values):
        """`values` (vectors of one type) through an empty inline-assembly statement with side
        effects: code that makes them is emitted before it and code that uses them after, so
        the machine scheduler cannot interleave the two (it keeps a loop's order)."""
        n, kind = len(values), values[0].type
        constraints = ",".join(["=x"] * n + [str(i) for i in range(n)])
        signature = ir.FunctionType(ir.LiteralStructType([kind] * n), [kind] * n)
        result = self.b.asm(signature, "", constraints, values, True)
        return [self.b.extract_value(result, i) for i in range(n)]

    def add_pair_products(self, acc, left, right):
        """acc <n/2 x i32> plus, in lane m, left[2m] * right[2m] + left[2m + 1] * right[2m + 1]
        (<n x i16> each, n = 16 or 32): one vpdpwssd with VNNI, vpmaddwd + vpaddd otherwise.
        With AVX-512 VNNI the vpdpwssd is inline assembly: from LLVM's intrinsic, its machine
        combiner splits chains of them into vpmaddwd + vpaddd to shorten their latency, which
        slows a throughput-bound loop like ours."""
        b, n = self.b, left.type.count
        as_i32 = vec(I32, n // 2)
        operands = [acc, b.bitcast(left, as_i32), b.bitcast(right, as_i32)]
        if self.vnni512 and n in (16, 32):
            return b.asm(ir.FunctionType(as_i32, [as_i32] * 3), "vpdpwssd $3, $2, $0", "=v,0,v,v", operands, False)
        if n == 16 and self.vnni:
            return self.call("llvm.x86.avx512.vpdpwssd.256", as_i32, *operands)
        if n == 16 and self.avx2 or n == 32 and self.avx512:
            name = "llvm.x86.avx2.pmadd.wd" if n == 16 else "llvm.x86.avx512.pmaddw.d.512"
            return b.add(acc, self.call(name, as_i32, left, right))
        products = b.mul(b.sext(left, vec(I32, n)), b.sext(right, vec(I32, n)))
        return b.add(acc, b.add(self.pick(products, range(0, n, 2)), self.pick(products, range(1, n, 2))))

    def dot_s8s8(self, left, right):
        """As dot_u8s8 for two signed vectors (|left| <= 128, |right| <= 127): |left| times
        right with left's sign."""
        if self.avx2:
            magnitude = self.call("llvm.abs.v32i8", left.type, left, ir.Constant(I1, 0))
            return self.dot_u8s8(magnitude, self.call("llvm.x86.avx2.psign.b", left.type, right, left))
        wide = vec(I32, 32)
        return self._sum_quads(self.b.mul(self.b.sext(left, wide), self.b.sext(right, wide)))

    def signed_like(self, values, signs):
        """values with the sign of `signs` (zero where `signs` is zero): vpsignb with AVX2,
        `signed_by` and a select of the zeros otherwise (AVX-512 has no 64-byte vpsignb).
        |values| <= 127."""
        negated = self.signed_by(values, signs)
        if self.avx2 and values.type.count == 32:
            return negated  # vpsignb zeroes them itself
        zero = ir.Constant(values.type, None)
        return self.b.select(self.b.icmp_signed("==", signs, zero), zero, negated)

    def signed_by(self, values, signs):
        """values negated where `signs` is negative, for `signs` never zero: vpsignb with AVX2,
        a masked subtract with AVX-512. |values| <= 127."""
        if self.avx2 and values.type.count == 32:
            return self.call("llvm.x86.avx2.psign.b", values.type, values, signs)
        b, zero = self.b, ir.Constant(values.type, None)
        return b.select(b.icmp_signed("<", signs, zero), b.sub(zero, values), values)

    def abs_bytes(self, values):
        return self.call(f"llvm.abs.v{values.type.count}i8", values.type, values, ir.Constant(I1, 0))

    def lookup16(self, table, indices):
        """table[indices] for a 16-entry table of int8 constants and a byte vector of indices
        0..15: vpshufb with AVX2 (the table repeated in each 16-byte lane), selects otherwise."""
        b, n = self.b, indices.type.count
        intrinsics = {16: "llvm.x86.ssse3.pshuf.b.128", 32: "llvm.x86.avx2.pshuf.b", 64: "llvm.x86.avx512.pshuf.b.512"}
        if self.avx2 and n in intrinsics and (n < 64 or self.avx512):
            lanes = ir.Constant(indices.type, [ir.Constant(I8, int(table[i % 16])) for i in range(n)])
            return self.call(intrinsics[n], indices.type, lanes, indices)
        result = self.const(I8, n, int(table[0]))
        for i in range(1, 16):
            result = b.select(b.icmp_unsigned("==", indices, self.const(I8, n, i)), self.const(I8, n, int(table[i])), result)
        return result

    def spread_words(self, words, lanes):
        """pick(words, lanes) for a <16 x i16> whose result takes each of its halves from one
        half of `words` (the scales of a block's sub-block): with AVX2 one vpshufb of those
        halves side by side, where LLVM would splat a lane with a shift and a vpbroadcastw,
        or a byte shuffle and a widening, for each sub-block."""
        if self.avx2 and words.type.count == 16 and len(lanes) == 16:
            halves = [{lane // 8 for lane in lanes[:8]}, {lane // 8 for lane in lanes[8:]}]
            if all(len(half) == 1 for half in halves):
                (low,), (high,) = halves
                source = self.pick(words, [8 * low + i for i in range(8)] + [8 * high + i for i in range(8)])
                mask = ir.Constant(vec(I8, 32), [ir.Constant(I8, 2 * (lane % 8) + byte) for lane in lanes for byte in (0, 1)])
                # inline assembly: LLVM turns a vpshufb of a constant mask back into its own shuffle
                spread = self.b.asm(ir.FunctionType(vec(I8, 32), [vec(I8, 32)] * 2), "vpshufb $2, $1, $0", "=x,x,xm",
                                    [self.b.bitcast(source, vec(I8, 32)), mask], False)
                return self.b.bitcast(spread, vec(I16, 16))
        return self.pick(words, lanes)

    def table(self, name, values):
        """i8* to a constant table of bytes in the module (one copy per module, by `name`)."""
        module = self.b.module
        data = bytes(values)
        table = module.globals.get(name)
        if table is None:
            kind = ir.ArrayType(I8, len(data))
            table = ir.GlobalVariable(module, kind, name=name)
            table.initializer = ir.Constant(kind, bytearray(data))
            table.global_constant, table.linkage = True, "internal"
        return self.b.bitcast(table, _BYTE_PTR)

    def gather(self, table, indices, width):
        """The `width`-byte entries table[i] for IR integer indices, one byte vector in order."""
        b = self.b
        parts = [self.load(table, b.mul(b.zext(i, I64), ir.Constant(I64, width)), I8, width) if width > 1
                 else b.insert_element(ir.Constant(vec(I8, 1), None), b.load(self.at(table, b.zext(i, I64))),
                                       ir.Constant(I32, 0))
                 for i in indices]
        while len(parts) > 1:
            parts = [self.shuffle(parts[k], parts[k + 1], range(2 * parts[k].type.count)) for k in range(0, len(parts), 2)]
        return parts[0]

    def e8m0_half(self, byte):
        """float32 2**(e - 128) of an E8M0 exponent byte e (ggml_e8m0_to_fp32_half)."""
        b = self.b
        e = b.zext(byte, I32)
        subnormal = b.shl(ir.Constant(I32, 0x00200000), e)
        normal = b.shl(b.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23))
        return b.bitcast(b.select(b.icmp_unsigned("<", e, ir.Constant(I32, 2)), subnormal, normal), FLOAT)

    def nibbles(self, packed):
        """(low, high) 4-bit halves of a byte vector."""
        n = packed.type.count
        return self.b.and_(packed, self.const(I8, n, 0x0F)), self.b.lshr(packed, self.const(I8, n, 4))


@intrinsic
def half_to_float(typingctx, bits):
    """float32 of the IEEE half whose bits are the low 16 of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return Emitter(context, builder).half_to_float(builder.trunc(args[0], I16))

    return types.float32(bits), codegen


HALVES_PER_STEP = 16


@intrinsic
def halves_into(typingctx, src, dst):
    """dst[:] <- float32 of the IEEE halves whose bits are src[:dst.size] (a uint16 row, which
    may be strided, and a contiguous float32 one; as many as the shorter holds),
    HALVES_PER_STEP at a time where src is contiguous."""
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array) and src.ndim == dst.ndim == 1
            and dst.layout == "C" and src.dtype == types.uint16 and dst.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        source, target = (context.make_array(kind)(context, builder, value) for kind, value in zip(sig.args, args))
        count = builder.select(builder.icmp_signed("<", source.nitems, target.nitems), source.nitems, target.nitems)
        halves, floats = e.pointer(sig.args[0], args[0]), e.pointer(sig.args[1], args[1])
        stride = builder.extract_value(source.strides, 0)  # bytes between halves

        def convert(index, n=None):  # the n halves (or the one) from `index`
            bits = e.load(halves, builder.mul(index, stride), I16, n)
            value = e.halves_to_floats(bits) if n else e.half_to_float(bits)
            target_at = e.at(floats, builder.shl(index, ir.Constant(I64, 2)))
            builder.store(value, builder.bitcast(target_at, value.type.as_pointer()), align=4)

        step = ir.Constant(I64, HALVES_PER_STEP)
        contiguous = builder.icmp_signed("==", stride, ir.Constant(I64, 2))
        steps = builder.select(contiguous, builder.udiv(count, step), ir.Constant(I64, 0))
        with cgutils.for_range(builder, steps) as loop:
            convert(builder.mul(loop.index, step), HALVES_PER_STEP)
        with cgutils.for_range_slice(builder, builder.mul(steps, step), count, ir.Constant(I64, 1)) as (index, _):
            convert(index)
        return context.get_dummy_value()

    return types.void(src, dst), codegen


SUM_LANES = 16  # float32 lanes in each of the two partial sums of `float_dot` and `float_sum`


def _ordered_sums(e, rows, other, count):
    """IR: for each i8* in `rows`, the sum of its float32 values (times `other`'s, unless None)
    over `count`: two vector partial sums over 2 * SUM_LANES values a step, one more step of
    SUM_LANES, the rest one by one, then a fixed tree. Without reassociation, no optimizer
    choice (vector width, unrolling, the function it is inlined into, the rows beside it) can
    change the order, so every caller gets the same bits; several rows interleave their
    independent sums."""
    builder = e.b

    def terms(base, index, n=None):  # the n terms (or the one) from `index`
        offset = builder.shl(index, ir.Constant(I64, 2))
        value = e.load(base, offset, FLOAT, n)
        return value if other is None else builder.fmul(value, e.load(other, offset, FLOAT, n), flags=CONTRACT)

    lanes = vec(FLOAT, SUM_LANES)
    sums = [[cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * SUM_LANES)) for _ in range(2)] for _ in rows]

    def add_to(total, base, index):
        builder.store(builder.fadd(builder.load(total), terms(base, index, SUM_LANES), flags=CONTRACT), total)

    pair = ir.Constant(I64, 2 * SUM_LANES)
    steps = builder.udiv(count, pair)
    with cgutils.for_range(builder, steps) as loop:
        first = builder.mul(loop.index, pair)
        for base, (low, high) in zip(rows, sums):
            add_to(low, base, first)
            add_to(high, base, builder.add(first, ir.Constant(I64, SUM_LANES)))
    done = builder.mul(steps, pair)
    with builder.if_then(builder.icmp_signed(">=", builder.sub(count, done), ir.Constant(I64, SUM_LANES))):
        for base, (low, _) in zip(rows, sums):
            add_to(low, base, done)
    tail_start = builder.mul(builder.udiv(count, ir.Constant(I64, SUM_LANES)), ir.Constant(I64, SUM_LANES))
    tails = [cgutils.alloca_once_value(builder, ir.Constant(FLOAT, 0.0)) for _ in rows]
    with cgutils.for_range_slice(builder, tail_start, count, ir.Constant(I64, 1)) as (index, _):
        for base, tail in zip(rows, tails):
            builder.store(builder.fadd(builder.load(tail), terms(base, index), flags=CONTRACT), tail)
    return [builder.fadd(e.hsum(e.fold8(builder.fadd(builder.load(low), builder.load(high)))), builder.load(tail))
            for (low, high), tail in zip(sums, tails)]


def _ordered_sum(products: bool):
    """codegen of the sum of a[i] (* b[i]) over the shorter row, in `_ordered_sums`' order."""

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        arrays = [context.make_array(kind)(context, builder, value) for kind, value in zip(sig.args, args)]
        count = arrays[0].nitems
        for other in arrays[1:]:
            count = builder.select(builder.icmp_signed("<", other.nitems, count), other.nitems, count)
        bases = [e.pointer(kind, value) for kind, value in zip(sig.args, args)]
        return _ordered_sums(e, bases[:1], bases[1] if products else None, count)[0]

    return codegen


DOTS_AT_ONCE = 4  # rows whose `float_dots` interleave (two vector partial sums each)


def _float_rows(*arrays):
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32
               for a in arrays)


@intrinsic
def float_dot(typingctx, a, b):
    """sum of a[i] * b[i] over the shorter of two contiguous float32 rows, in a fixed order
    (`_ordered_sum`): the same bits wherever it is compiled."""
    if not _float_rows(a, b):
        return None
    return types.float32(a, b), _ordered_sum(products=True)


@intrinsic
def float_dots(typingctx, a, b, out):
    """out[r] = float_dot(a[r], b) for each row of a (float32 [m, n], C-contiguous) with
    b float32 [n] and out float32 [m], contiguous: DOTS_AT_ONCE rows at a time, their
    independent sums interleaved, each in `float_dot`'s order (the same bits)."""
    if not (_float_rows(b, out) and isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C"
            and a.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        matrix, row, dots = (context.make_array(kind)(context, builder, value) for kind, value in zip(sig.args, args))
        m, n = (builder.extract_value(matrix.shape, i) for i in range(2))
        rows = builder.select(builder.icmp_signed("<", dots.nitems, m), dots.nitems, m)
        count = builder.select(builder.icmp_signed("<", row.nitems, n), row.nitems, n)
        bases = [e.pointer(kind, value) for kind, value in zip(sig.args, args)]
        row_bytes = builder.shl(n, ir.Constant(I64, 2))

        def dot_rows(first, k):  # rows first..first+k-1 into out
            starts = [builder.add(first, ir.Constant(I64, r)) for r in range(k)]
            sums = _ordered_sums(e, [e.at(bases[0], builder.mul(r, row_bytes)) for r in starts], bases[1], count)
            for r, total in zip(starts, sums):
                target = e.at(bases[2], builder.shl(r, ir.Constant(I64, 2)))
                builder.store(total, builder.bitcast(target, FLOAT.as_pointer()), align=4)

        at_once = ir.Constant(I64, DOTS_AT_ONCE)
        with cgutils.for_range(builder, builder.udiv(rows, at_once)) as loop:
            dot_rows(builder.mul(loop.index, at_once), DOTS_AT_ONCE)
        with cgutils.for_range_slice(builder, builder.mul(builder.udiv(rows, at_once), at_once), rows,
                                     ir.Constant(I64, 1)) as (index, _):
            dot_rows(index, 1)
        return context.get_dummy_value()

    return types.void(a, b, out), codegen


WEIGHTED_VECTORS = 4  # vectors of SUM_LANES outputs `weighted_rows_into` keeps in registers over the rows


@intrinsic
def weighted_rows_into(typingctx, weights, rows, out):
    """out[d] += weights[p] * rows[p, d] for p = 0, 1, ... in order, each element a chain of
    multiply-adds (fused where the CPU has FMA) as `out[d] += w * row[d]` row after row gives,
    the same bits; weights float32 [m] and out float32 [n] contiguous, rows float32 [m, n]
    C-contiguous. A block of WEIGHTED_VECTORS * SUM_LANES outputs stays in registers over all
    the rows (then blocks of SUM_LANES, then single outputs), instead of a load and a store of
    every output for every row."""
    if not (_float_rows(weights, out) and isinstance(rows, types.Array) and rows.ndim == 2 and rows.layout == "C"
            and rows.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        e = Emitter(context, builder)
        matrix = context.make_array(sig.args[1])(context, builder, args[1])
        m, n = (builder.extract_value(matrix.shape, i) for i in range(2))
        w_base, rows_base, out_base = (e.pointer(kind, value) for kind, value in zip(sig.args, args))
        row_bytes = builder.shl(n, ir.Constant(I64, 2))

        def outputs(first, lanes, vectors):  # outputs first.. (lanes a vector, `vectors` of them) over every row
            offsets = [builder.shl(builder.add(first, ir.Constant(I64, lanes * v)), ir.Constant(I64, 2))
                       for v in range(vectors)]
            sums = [cgutils.alloca_once_value(builder, e.load(out_base, offset, FLOAT, lanes if lanes > 1 else None))
                    for offset in offsets]
            with cgutils.for_range(builder, m) as loop:
                weight = e.load(w_base, builder.shl(loop.index, ir.Constant(I64, 2)), FLOAT)
                if lanes > 1:
                    weight = e.splat(weight, lanes)
                row = e.at(rows_base, builder.mul(loop.index, row_bytes))
                for total, offset in zip(sums, offsets):
                    term = e.load(row, offset, FLOAT, lanes if lanes > 1 else None)
                    builder.store(e.fma(weight, term, builder.load(total)), total)
            for total, offset in zip(sums, offsets):
                target = e.at(out_base, offset)
                builder.store(builder.load(total), builder.bitcast(target, total.type.pointee.as_pointer()), align=4)

        def blocks(start, width, vectors):  # whole blocks of width outputs from start; returns where they end
            count = builder.udiv(builder.sub(n, start), ir.Constant(I64, width))
            with cgutils.for_range(builder, count) as loop:
                outputs(builder.add(start, builder.mul(loop.index, ir.Constant(I64, width))), width // vectors, vectors)
            return builder.add(start, builder.mul(count, ir.Constant(I64, width)))

        done = blocks(ir.Constant(I64, 0), WEIGHTED_VECTORS * SUM_LANES, WEIGHTED_VECTORS)
        done = blocks(done, SUM_LANES, 1)
        blocks(done, 1, 1)
        return context.get_dummy_value()

    return types.void(weights, rows, out), codegen


@intrinsic
def float_sum(typingctx, a):
    """sum of a contiguous float32 row, in `float_dot`'s fixed order."""
    if not _float_rows(a):
        return None
    return types.float32(a), _ordered_sum(products=False)


@intrinsic
def bf16_to_float(typingctx, bits):
    """float32 of the bfloat16 whose bits are the low 16 of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        wide = builder.zext(builder.trunc(args[0], I16), I32)
        return builder.bitcast(builder.shl(wide, ir.Constant(I32, 16)), FLOAT)

    return types.float32(bits), codegen


@intrinsic
def int_bits_to_float(typingctx, bits):
    """The float32 whose bits are the low 32 of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], I32) if bits.bitwidth > 32 else args[0], FLOAT)

    return types.float32(bits), codegen


@intrinsic
def prefetch_line(typingctx, array, byte_offset):
    """Prefetch the cache line of `array`'s byte `byte_offset` into all cache levels."""
    if not isinstance(array, types.Array) or not isinstance(byte_offset, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder)
        offset = context.cast(builder, args[1], signature.args[1], types.int64)
        e.prefetch(e.pointer(signature.args[0], args[0], offset))
        return context.get_dummy_value()

    return types.void(array, byte_offset), codegen
