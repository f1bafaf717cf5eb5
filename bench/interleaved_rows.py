"""Benchmark: Q4_K rows interleaved 16 at a time, against the row dots, for one activation row.

A probe of a layout that the runtime does not use (yet): 16 rows' blocks of 256 weights stored
together. Their f16 d and dmin come first, then their 6-bit mins and scales a byte each, then
their nibbles, 4 bytes of each row in turn. One vpdpbusd then multiplies 4 weights of 16 rows
by 4 activation values broadcast from memory, and each scale and min applies to 16 rows in one
vector, where the row dot spreads a block's scales over its own lanes. The block totals are the
integers of `blocks.INTEGER_TOTALS`, with the same float operations in the same order, so its
outputs must equal the integer-total row dots bit for bit; the script checks that.

Prints ns a row-block in L2 (one thread) for it and for the row dots (a token decoded alone's
float lanes, and the integer totals), then GB/s of Q4_K bytes from DRAM on 1 and 2 threads,
beside a pass that only loads the interleaved bytes (the memory side's own speed). Needs
AVX-512 VNNI.

    python bench/interleaved_rows.py [--mb 256] [--repeat 7] [--prefetch 8192]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from colibri.formats.encodings import block_size, row_bytes
from colibri.runtime import kernels
from colibri.runtime.kernels.blocks import KEEP_ORDER
from colibri.runtime.kernels.emitter import FLOAT, I8, I16, I32, I64, Emitter, target_isa, vec
from kernel_speed import COLS, IN_CACHE_PASSES, in_cache_ns_per_block, weight_bytes

ROWS = 16  # rows interleaved
BLOCK = block_size("Q4_K")[1]  # bytes of a Q4_K block
HEAD = 64 + 128 + 128  # d and dmin (f16), then mins and scales (a byte each), of 16 rows
GROUP_BYTES = HEAD + ROWS * 128  # 16 rows' blocks of 256 weights


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins [..., 8] of Q4_K's 12 packed bytes [..., 12], as ggml unpacks them."""
    q = packed.astype(np.int32)
    scales, mins = np.empty(q.shape[:-1] + (8,), np.uint8), np.empty(q.shape[:-1] + (8,), np.uint8)
    scales[..., :4], mins[..., :4] = q[..., 0:4] & 63, q[..., 4:8] & 63
    scales[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return scales, mins


def interleave(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_K rows [rows, cols] (bytes) -> the 16-row layout, 64-byte aligned (uint8, flat)."""
    nb = cols // 256
    blocks = data.reshape(rows // ROWS, ROWS, nb, BLOCK).transpose(0, 2, 1, 3)  # [group, block, row, byte]
    scales, mins = _scales_and_mins(blocks[..., 4:16])
    parts = [blocks[..., 0:2], blocks[..., 2:4], mins.transpose(0, 1, 3, 2), scales.transpose(0, 1, 3, 2),
             blocks[..., 16:].reshape(rows // ROWS, nb, ROWS, 32, 4).transpose(0, 1, 3, 2, 4)]
    layout = np.concatenate([p.reshape(rows // ROWS, nb, -1) for p in parts], axis=2)
    raw = np.empty(layout.size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + layout.size]
    out[:] = layout.reshape(-1)
    return out


def _rows16_codegen(load_only: bool, prefetch: int):
    def codegen(context, builder, signature, args):
        e, b = Emitter(context, builder), builder
        start = e.pointer(signature.args[0], args[0], args[1])
        xq0, xd0, xb0, out = (e.pointer(signature.args[i], args[i]) for i in (3, 4, 5, 6))
        total = cgutils.alloca_once_value(b, ir.Constant(vec(FLOAT, 16), [0.0] * 16))
        low = e.const(I8, 64, 0x0F)
        with cgutils.for_range(b, args[2]) as loop:
            k = loop.index
            group = e.at(start, b.mul(k, ir.Constant(I64, GROUP_BYTES)))
            if prefetch:  # one line a block, far ahead: more lines a block measured slower
                e.prefetch(e.at(group, prefetch))
            xq, xb = e.at(xq0, b.mul(k, ir.Constant(I64, 256))), e.at(xb0, b.mul(k, ir.Constant(I64, 32)))
            sums = b.sext(e.load(xb, 0, I16, 16), vec(I32, 16))
            imin = e.const(I32, 16, 0)
            for j in range(8):  # the mins first, so that the block's bytes are read in order
                sum32 = b.add(b.extract_element(sums, ir.Constant(I32, 2 * j)), b.extract_element(sums, ir.Constant(I32, 2 * j + 1)))
                imin = b.add(imin, b.mul(b.zext(e.load(group, 64 + 16 * j, I8, 16), vec(I32, 16)), e.splat(sum32, 16)))
            isum = e.const(I32, 16, 0)
            for g in range(4):  # nibbles of sub-blocks 2g (low) and 2g + 1 (high)
                accs = [e.const(I32, 16, 0), e.const(I32, 16, 0)]
                for c in range(8):
                    weights = e.load(group, HEAD + 64 * (8 * g + c), I8, 64)
                    if load_only:
                        accs[0] = b.xor(accs[0], b.bitcast(weights, vec(I32, 16)))
                        continue
                    high = b.bitcast(b.lshr(b.bitcast(weights, vec(I16, 32)), e.const(I16, 32, 4)), vec(I8, 64))
                    for h, nibbles in enumerate((b.and_(weights, low), b.and_(high, low))):
                        x = e.splat(e.load(xq, 64 * g + 32 * h + 4 * c, I32), 16)
                        accs[h] = e.call("llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), accs[h],
                                         b.bitcast(nibbles, vec(I32, 16)), x)
                for h in range(2):
                    scale = b.zext(e.load(group, 192 + 16 * (2 * g + h), I8, 16), vec(I32, 16))
                    isum = b.add(isum, b.mul(accs[h], scale))
            d, dmin = (e.halves_to_floats(e.load(group, offset, I16, 16)) for offset in (0, 32))
            xd = e.splat(e.load(e.at(xd0, b.mul(k, ir.Constant(I64, 4))), 0, FLOAT), 16)

            def times(value, scale):  # blocks.block_total's products, on 16 rows
                return b.fmul(b.sitofp(value, vec(FLOAT, 16)), b.fmul(scale, xd, flags=KEEP_ORDER), flags=KEEP_ORDER)

            value = b.fsub(times(isum, d), times(imin, dmin), flags=KEEP_ORDER)
            b.store(b.fadd(b.load(total), value, flags=KEEP_ORDER), total)
        b.store(b.load(total), b.bitcast(out, vec(FLOAT, 16).as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _rows16(load_only: bool, prefetch: int):
    @intrinsic
    def rows16(typingctx, w, offset, nblocks, xq, xd, xb, out):
        """16 outputs at `out`: the dots of 16 interleaved rows' `nblocks` blocks at byte
        `offset` of `w` with one Q8_K activation row (levels, scales, sums per 16)."""
        return types.void(w, offset, nblocks, xq, xd, xb, out), _rows16_codegen(load_only, prefetch)

    return rows16


def _kernels(load_only: bool, prefetch: int):
    rows16 = _rows16(load_only, prefetch)

    @njit(nogil=True)
    def in_cache(packed, groups, nb, q, d, bsums, out, passes):
        for _ in range(passes):
            for group in range(groups):
                rows16(packed, group * nb * GROUP_BYTES, nb, q, d, bsums, out[ROWS * group:])

    @njit(nogil=True, parallel=True)
    def matvec(packed, groups, nb, q, d, bsums, out):
        for group in prange(groups):
            rows16(packed, group * nb * GROUP_BYTES, nb, q, d, bsums, out[ROWS * group:])

    return in_cache, matvec


def best_seconds(run, repeat: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def problem(rows: int, cols: int, seed: int):
    """A Q4_K matrix, its interleaved bytes, and one activation row as the integer totals and
    as a token decoded alone's float lanes take it."""
    matrix = kernels.Matrix(weight_bytes("Q4_K", rows, cols), "Q4_K", rows, cols)
    x = np.random.default_rng(seed).standard_normal((1, cols)).astype(np.float32)
    act = matrix.activation(x, tiles=False)
    with kernels.decoding_alone():
        lanes = matrix.activation(x, tiles=False)
    return matrix, interleave(np.asarray(matrix.data).reshape(-1), rows, cols), act, lanes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="Q4_K bytes of the DRAM matrix, MB (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=7, help="timings of each, the best kept (default: %(default)s)")
    parser.add_argument("--prefetch", type=int, default=8192,
                        help="bytes ahead of each block whose line is prefetched, 0: none (default: %(default)s)")
    args = parser.parse_args()
    if not target_isa().vnni512:
        raise SystemExit("interleaved_rows.py: the probe needs AVX-512 VNNI")
    in_cache, matvec = _kernels(False, args.prefetch)
    _, load_pass = _kernels(True, args.prefetch)

    rows = 64  # 64 x COLS weights stay in a core's L2, as kernel_speed's in-cache rows
    matrix, packed, act, _ = problem(rows, COLS, 1)
    out, nb = np.zeros(rows, np.float32), COLS // 256
    in_cache(packed, rows // ROWS, nb, act.q[0], act.d[0], act.bsums[0], out, 1)
    same = np.array_equal(out, matrix.times(act, 1)[0])
    ns = best_seconds(lambda: in_cache(packed, rows // ROWS, nb, act.q[0], act.d[0], act.bsums[0], out, IN_CACHE_PASSES),
                      args.repeat) / IN_CACHE_PASSES / (rows * nb) * 1e9
    print(f"16 rows interleaved, bits equal to the integer-total row dots: {'yes' if same else 'NO'}")
    print(f"one thread, rows in L2, ns a row-block: interleaved {ns:.2f}, row dot with float lanes "
          f"{in_cache_ns_per_block('Q4_K', args.repeat):.2f}")

    cols = 7168
    rows = (args.mb << 20) // row_bytes("Q4_K", cols) // ROWS * ROWS
    matrix, packed, act, lanes = problem(rows, cols, 2)
    out, nb = np.zeros(rows, np.float32), cols // 256
    runs = {"interleaved": lambda: matvec(packed, rows // ROWS, nb, act.q[0], act.d[0], act.bsums[0], out),
            "its bytes loaded only": lambda: load_pass(packed, rows // ROWS, nb, act.q[0], act.d[0], act.bsums[0], out),
            "row dot, float lanes": lambda: matrix.times(lanes, 1),
            "row dot, integer totals": lambda: matrix.times(act, 1)}
    print(f"\nfrom DRAM, {matrix.data.nbytes / 1e6:.0f} MB of Q4_K ({rows} x {cols}), GB/s of Q4_K bytes, best of {args.repeat}:")
    print(f"{'':26}" + "".join(f"{t} thread{'s' if t > 1 else '':3}" for t in (1, 2)))
    speeds = {name: [] for name in runs}
    for threads in (1, 2):
        kernels.set_threads(threads)
        for name, run in runs.items():
            speeds[name].append(matrix.data.nbytes / best_seconds(run, args.repeat) / 1e9)
    for name, values in speeds.items():
        print(f"{name:26}" + "".join(f"{v:10.1f}" for v in values))


if __name__ == "__main__":
    main()
