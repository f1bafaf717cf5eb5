"""runtime.kernels against gguf's decoder and float64 products.

Weights are random rows quantized by our ggml-identical quantizer; the reference decodes
them with `gguf.quants.dequantize` and multiplies in float64. The exact path must agree to
1e-5 of the output's largest magnitude, the int8 fast path to `FAST_PATH_TOLERANCE`.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import llvmlite.binding
import numba
import numpy as np
import pytest

from colibri.convert.quantize_q4k import IMATRIX_NEEDED, quantize
from colibri.formats.encodings import ENCODINGS
from colibri.runtime import kernels
from colibri.runtime.kernels import int8_tiles, threads
from colibri.runtime.kernels.emitter import (
    float_dot, float_dots, float_sum, halves_into, target_environment, weighted_rows_into,
)

EXACT_TOLERANCE = 1e-5
ROWS = 37  # not a multiple of the thread count
# A row length per encoding, 256 to 2048 weights; 288 is not a whole number of 256-chunks.
COLS = {"F32": 288, "F16": 256, "BF16": 2048, "Q8_0": 288, "Q5_0": 1056, "Q5_1": 288, "Q4_0": 544, "Q4_1": 320,
        "Q2_K": 512, "Q3_K": 768, "Q4_K": 2048, "Q5_K": 256, "Q6_K": 1280, "IQ4_NL": 352, "IQ4_XS": 768,
        "MXFP4": 576, "TQ1_0": 512, "TQ2_0": 1024, "IQ3_XXS": 512, "IQ3_S": 768, "IQ2_XXS": 1280, "IQ2_XS": 256,
        "IQ2_S": 512, "IQ1_S": 768, "IQ1_M": 1024}


GOLDEN_ALL = Path(__file__).parent / "data" / "ggml_quants_golden_all.npz"


def random_weights(encoding, rows, cols, seed=0):
    """(bytes [rows, row_bytes], float64 decoding of them by gguf)."""
    rng = np.random.default_rng(seed)
    imatrix = rng.random(cols).astype(np.float32) + np.float32(0.1) if encoding in IMATRIX_NEEDED else None
    w = quantize(rng.standard_normal((rows, cols)).astype(np.float32), encoding, imatrix)
    return w, gguf.quants.dequantize(w, gguf.GGMLQuantizationType[encoding]).astype(np.float64)


def relative_error(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.fixture(scope="module", params=ENCODINGS)
def matrix(request):
    encoding = request.param
    w, reference = random_weights(encoding, ROWS, COLS[encoding])
    return encoding, w, reference


@pytest.fixture(scope="module")
def activations():
    return np.random.default_rng(1).standard_normal((17, 2048)).astype(np.float32)


def test_dequantize_rows_is_bit_identical_to_gguf(matrix):
    encoding, w, reference = matrix
    rows = kernels.dequantize_rows(w, encoding, reference.shape[1], 5, 30)
    assert rows.dtype == np.float32 and rows.shape == (30, reference.shape[1])
    assert np.array_equal(rows, reference[5:35].astype(np.float32))


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_products_match_float64(matrix, activations, exact):
    encoding, w, reference = matrix
    cols = reference.shape[1]
    tolerance = kernels.FAST_PATH_TOLERANCE if not exact and encoding in kernels.FAST_ENCODINGS else EXACT_TOLERANCE
    x = activations[:, :cols]
    y = kernels.matvec(w, encoding, ROWS, cols, x[0], exact=exact)
    assert y.dtype == np.float32 and y.shape == (ROWS,)
    assert relative_error(y, reference @ x[0]) <= tolerance
    for n in (1, 3, 6, 13, 17):  # singles, a half group, whole groups and both
        y = kernels.matmul(w, encoding, ROWS, cols, x[:n], exact=exact)
        assert y.dtype == np.float32 and y.shape == (n, ROWS)
        assert relative_error(y, x[:n].astype(np.float64) @ reference.T) <= tolerance


def test_fast_path_is_not_the_exact_path(activations):
    w, _ = random_weights("Q4_K", ROWS, 256)
    fast, exact = (kernels.matvec(w, "Q4_K", ROWS, 256, activations[0, :256], exact=e) for e in (False, True))
    assert not np.array_equal(fast, exact)


def test_results_do_not_depend_on_the_thread_count(activations):
    w, _ = random_weights("Q4_K", ROWS, 2048)
    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            kernels.set_threads(threads)
            results.append([kernels.matmul(w, "Q4_K", ROWS, 2048, activations[:3], exact=e) for e in (False, True)])
    finally:
        kernels.set_threads(before)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("encoding", ["Q4_K", "Q5_K", "Q6_K"])
def test_many_activations_give_each_the_bits_of_its_own_row_dots(encoding):
    """A product of many rows (a prompt's, a batch step's; on the int8 tiles where the CPU has
    AVX-512 VNNI: panels of rows, bands of 16 activations, the last ones short) gives every
    activation the bits it gets alone; and the tile kernel itself does, for fewer activations
    than take it. A token decoded alone takes the row dots' float lanes."""
    rows, cols = 45, COLS[encoding]  # two panels, the second not a whole tile
    w, _ = random_weights(encoding, rows, cols)
    matrix = kernels.Matrix(w, encoding, rows, cols)
    x = np.random.default_rng(4).standard_normal((40, cols)).astype(np.float32)
    alone = np.stack([matrix(x[i:i + 1])[0] for i in range(len(x))])
    with kernels.without_amx():  # a batch step's rows (a prompt's too, but on AMX's bfloat16 tiles)
        for n in (3, int8_tiles.MIN_ACTIVATIONS, 17, 40):
            assert np.array_equal(matrix(x[:n]).view(np.uint32), alone[:n].view(np.uint32)), n
    with kernels.decoding_alone():
        lone = np.stack([matrix(x[i:i + 1])[0] for i in range(len(x))])
    reference = x.astype(np.float64) @ gguf.quants.dequantize(w, gguf.GGMLQuantizationType[encoding]).T
    assert relative_error(lone, reference) <= kernels.FAST_PATH_TOLERANCE
    assert relative_error(alone, reference) <= kernels.FAST_PATH_TOLERANCE
    assert not int8_tiles.available() or not np.array_equal(lone, alone)  # two numerics where the tiles are
    if int8_tiles.available():
        out = np.empty((3, rows), np.float32)
        int8_tiles.tiled_rows_times(matrix.tag, matrix.data, 0, rows, matrix.row_nbytes, cols, matrix.activation(x[:3]),
                                    out)
        assert np.array_equal(out.view(np.uint32), alone[:3].view(np.uint32))


def test_activations_packed_a_share_at_a_time_keep_the_bits_of_their_row_dots():
    """Rows so long that the tile kernel packs 40 activations in three shares (PACKED_BYTES):
    every activation gets the bits of its own row dots."""
    if not int8_tiles.available():
        pytest.skip("no AVX-512 VNNI: products take the row dots")
    rows, cols = 9, 131072
    assert 2 * int8_tiles.activations_a_share(cols) < 40  # three shares, the last a short one
    w, _ = random_weights("Q4_K", rows, cols)
    matrix = kernels.Matrix(w, "Q4_K", rows, cols)
    x = np.random.default_rng(5).standard_normal((40, cols)).astype(np.float32)
    alone = np.stack([matrix(x[i:i + 1])[0] for i in range(len(x))])
    out = np.empty((40, rows), np.float32)
    int8_tiles.tiled_rows_times(matrix.tag, matrix.data, 0, rows, matrix.row_nbytes, cols, matrix.activation(x, tiles=False),
                                out)
    assert np.array_equal(out.view(np.uint32), alone.view(np.uint32))


def expert_records(encodings, ffn, hidden, k, seed=0):
    """k expert records (gate, up, down back to back, padded to 4096 bytes, as in the
    layout) and their float64 matrices."""
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    matrices, blobs = [], []
    for j in range(k):
        parts = [random_weights(encoding, *shape, seed=seed + 3 * j + m)
                 for m, (encoding, shape) in enumerate(zip(encodings, shapes))]
        blobs.append(b"".join(part.tobytes() for part, _ in parts))
        matrices.append([reference for _, reference in parts])
    offsets = (0, len(parts[0][0].tobytes()), len(parts[0][0].tobytes()) + len(parts[1][0].tobytes()))
    stride = -(-len(blobs[0]) // 4096) * 4096
    records = np.zeros((k, stride), np.uint8)
    for j, blob in enumerate(blobs):
        records[j, :len(blob)] = np.frombuffer(blob, np.uint8)
    return records, offsets, matrices


def expert_reference(matrices, x):
    gate, up, down = matrices
    g, u = x @ gate.T, x @ up.T
    return (g / (1 + np.exp(-g)) * u) @ down.T


# (gate, up, down) encodings, ffn, hidden, exact: the Q4_K_M choice on both paths, the
# fallback block types, and float weights mixed with int8 activations.
EXPERTS = [(("Q4_K", "Q4_K", "Q6_K"), 512, 768, False), (("Q4_K", "Q4_K", "Q6_K"), 512, 768, True),
           (("Q8_0", "Q5_1", "Q5_0"), 96, 288, False), (("BF16", "Q4_K", "F16"), 256, 256, False),
           (("MXFP4", "MXFP4", "MXFP4"), 96, 256, False), (("IQ4_XS", "IQ4_XS", "IQ4_XS"), 256, 512, False),
           (("IQ2_XXS", "IQ2_XXS", "IQ3_XXS"), 256, 512, False), (("IQ1_S", "IQ1_S", "IQ1_M"), 256, 256, False)]


@pytest.mark.parametrize("encodings, ffn, hidden, exact", EXPERTS,
                         ids=["-".join(e[0]) + ("-exact" if e[3] else "-fast") for e in EXPERTS])
def test_moe_experts_match_reference(encodings, ffn, hidden, exact):
    k = 3
    records, offsets, matrices = expert_records(encodings, ffn, hidden, k)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(hidden).astype(np.float32)
    weights = rng.random(k).astype(np.float32)
    want = sum(weights[j] * expert_reference(matrices[j], x.astype(np.float64)) for j in range(k))
    got = kernels.moe_experts(records, encodings, offsets, ffn, hidden, x, weights, exact=exact)
    assert got.dtype == np.float32 and got.shape == (hidden,)
    # two products in a row: the int8 path's errors add up
    assert relative_error(got, want) <= (EXACT_TOLERANCE if exact else 2 * kernels.FAST_PATH_TOLERANCE)

    for n in (1, 3):
        xs = rng.standard_normal((n, hidden)).astype(np.float32)
        got = kernels.moe_experts_batch(records[1], encodings, offsets, ffn, hidden, xs, exact=exact)
        assert got.dtype == np.float32 and got.shape == (n, hidden)
        want = expert_reference(matrices[1], xs.astype(np.float64))
        assert relative_error(got, want) <= (EXACT_TOLERANCE if exact else 2 * kernels.FAST_PATH_TOLERANCE)


def test_bad_arguments_are_refused():
    w, _ = random_weights("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="shape"):
        kernels.matvec(w, "Q8_0", 4, 64, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="bytes"):
        kernels.matvec(w, "Q8_0", 5, 64, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="multiple"):
        kernels.matvec(w, "Q8_0", 4, 48, np.zeros(48, np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.moe_experts(np.zeros((2, 100), np.uint8), ("Q8_0",) * 3, (0, 0, 0), 32, 32,
                            np.zeros(32, np.float32), np.ones(2, np.float32))


def test_set_threads_warns_once_about_workqueue(monkeypatch):
    monkeypatch.setattr(threads.numba, "threading_layer", lambda: "workqueue")
    monkeypatch.setattr(threads, "_warned_workqueue", False)
    with pytest.warns(RuntimeWarning, match="workqueue"):
        kernels.set_threads(numba.get_num_threads())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.set_threads(numba.get_num_threads())


def every_half() -> np.ndarray:
    """The bits of every finite IEEE half, subnormals and both zeros included."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    return bits[np.isfinite(bits.view(np.float16))]


@numba.njit(cache=True)
def _halves_into(src, dst):
    halves_into(src, dst)


@numba.njit(cache=True)
def _halves_of_a_column_slice(src, width, dst):
    halves_into(src[:, :width][0], dst)  # typed as strided ("A"), its halves adjacent


def test_halves_convert_exactly_in_steps_and_remainders():
    bits = every_half()
    got = np.full(bits.size, np.nan, np.float32)
    _halves_into(bits, got)
    assert np.array_equal(got.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))
    for n in (0, 1, 15, 16, 17, 131):
        row = np.full(n + 2, 7.0, np.float32)
        _halves_into(bits[:n], row)  # the shorter row decides how many
        assert np.array_equal(row[:n], bits[:n].view(np.float16).astype(np.float32)) and (row[n:] == 7.0).all()
    expected = bits.view(np.float16).astype(np.float32)
    every_third = np.empty(45, np.float32)
    _halves_into(bits[:135:3], every_third)  # strided: one by one
    assert np.array_equal(every_third, expected[:135:3])
    for width in (16, 37):
        row = np.empty(width, np.float32)
        _halves_of_a_column_slice(bits[:40 * 64].reshape(40, 64), width, row)
        assert np.array_equal(row, expected[:width])


@numba.njit(cache=True)
def _ordered_sums_serial(a, b, dots, sums):
    for i in range(a.shape[0]):
        dots[i], sums[i] = float_dot(a[i], b[i]), float_sum(a[i])


@numba.njit(cache=True, parallel=True, fastmath=True)
def _ordered_sums_parallel(a, b, dots, sums):
    for i in numba.prange(a.shape[0]):
        dots[i], sums[i] = float_dot(a[i], b[i]), float_sum(a[i])


def test_float_sums_give_the_same_bits_in_any_caller_and_the_float64_sum():
    """float_dot and float_sum add in one fixed order: compiled into a serial function or a
    parallel fastmath one, every length (steps, the half step, the tail) gives the same bits."""
    rng = np.random.default_rng(7)
    for n in (0, 1, 15, 16, 17, 31, 32, 33, 48, 50, 64, 129, 320):
        a, b = (rng.standard_normal((5, n)).astype(np.float32) for _ in range(2))
        results = []
        for kernel in (_ordered_sums_serial, _ordered_sums_parallel):
            dots, sums = np.empty(5, np.float32), np.empty(5, np.float32)
            kernel(a, b, dots, sums)
            results.append((dots, sums))
        (dots, sums), (parallel_dots, parallel_sums) = results
        assert np.array_equal(dots.view(np.uint32), parallel_dots.view(np.uint32))
        assert np.array_equal(sums.view(np.uint32), parallel_sums.view(np.uint32))
        scale = np.abs(a).sum(axis=1) * (1 + np.abs(b).max(initial=0)) + 1e-30
        assert (np.abs(dots - (a.astype(np.float64) * b).sum(axis=1)) <= 1e-6 * scale).all()
        assert (np.abs(sums - a.astype(np.float64).sum(axis=1)) <= 1e-6 * scale).all()


@numba.njit(cache=True, fastmath=True)
def _dots_of_rows(a, b, out):
    float_dots(a, b, out)


def test_float_dots_give_each_rows_float_dot_bits():
    """float_dots interleaves up to DOTS_AT_ONCE rows' sums: each row still gets float_dot's
    bits, for any row count (whole groups and the rows after them) and length."""
    rng = np.random.default_rng(8)
    for m in (1, 3, 4, 5, 9, 16):
        for n in (1, 17, 48, 320):
            a, b = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
            together, alone = np.empty(m, np.float32), np.empty(m, np.float32)
            _dots_of_rows(a, b, together)
            _ordered_sums_serial(a, np.repeat(b[None], m, axis=0), alone, np.empty(m, np.float32))
            assert np.array_equal(together.view(np.uint32), alone.view(np.uint32)), (m, n)


@numba.njit(cache=True, fastmath=True)
def _weighted_rows_by_loops(weights, rows, out):
    for p in range(rows.shape[0]):
        for d in range(rows.shape[1]):
            out[d] += weights[p] * rows[p, d]


@numba.njit(cache=True)
def _weighted_rows(weights, rows, out):
    weighted_rows_into(weights, rows, out)


def test_weighted_rows_add_each_row_in_order_as_a_loop_does():
    """weighted_rows_into keeps blocks of outputs in registers over the rows: every output
    gets the bits of adding weight * row, row after row, to it (whole blocks, single vectors,
    single outputs; no rows at all)."""
    rng = np.random.default_rng(9)
    for m in (0, 1, 7, 33):
        for n in (1, 15, 16, 64, 65, 200, 512):
            weights, rows = rng.standard_normal(m).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
            start = rng.standard_normal(n).astype(np.float32)
            by_loops, blocked = start.copy(), start.copy()
            _weighted_rows_by_loops(weights, rows, by_loops)
            _weighted_rows(weights, rows, blocked)
            assert np.array_equal(blocked.view(np.uint32), by_loops.view(np.uint32)), (m, n)


COMPILED_OR_LOADED = """
import sys
import numpy as np
from colibri.runtime import kernels
rng = np.random.default_rng(3)
keys, values = (rng.standard_normal((300, 2, 64)).astype(np.float16).view(np.uint16) for _ in range(2))
q = rng.standard_normal((40, 8, 64)).astype(np.float32)
np.savez(sys.argv[1], kernels.attention(q[-1:], keys, values, 299, 0.125), kernels.attention(q, keys, values, 260, 0.125),
         kernels.rms_norm(q.reshape(-1, 64), np.ones(64, np.float32), 1e-6))
"""


def test_a_process_that_compiles_the_kernels_gets_the_bits_of_one_that_loads_them(tmp_path):
    """numba runs freshly compiled code in the process that compiles it and the cached object
    code in later ones; decode and prompt attention and the RMS norm give the same bits in both
    (their sums have one order, whatever the optimizer makes of the functions around them)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    for name in ("compiled", "loaded"):
        subprocess.run([sys.executable, "-c", COMPILED_OR_LOADED, str(tmp_path / f"{name}.npz")], env=env, check=True)
    compiled, loaded = np.load(tmp_path / "compiled.npz"), np.load(tmp_path / "loaded.npz")
    for key in compiled.files:
        assert np.array_equal(compiled[key].view(np.uint32), loaded[key].view(np.uint32)), key


PRODUCTS_FOR_CPU = """
import sys
import numba
import numpy as np
from colibri.runtime import kernels
from colibri.runtime.kernels.emitter import halves_into
x = np.load("x.npy")
halves = np.load("halves.npy")
floats = np.empty(halves.size, np.float32)
numba.njit(lambda src, dst: halves_into(src, dst))(halves, floats)
np.save("floats.npy", floats)
for encoding in sys.argv[1:]:
    w = np.load(f"{encoding}.npy")
    np.save(f"{encoding}-product.npy", kernels.matmul(w, encoding, w.shape[0], x.shape[1], x))
print(kernels.kernel_paths()["k_quant_dot"])
"""
# each target and the K-quant dot its kernels must use there (so that the target took effect)
TARGET_DOTS = {"generic": "portable vector IR", "avx2": "vpmaddubsw + vpmaddwd, 32 bytes",
               "avx2-vnni": "vpmaddubsw + vpdpwssd, 32 bytes"}
OTHER_CPU_ENCODINGS = ("Q4_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                       "IQ3_S", "IQ1_S", "IQ1_M")


def runs_here(target):
    return target != "avx2-vnni" or "+avxvnni" in llvmlite.binding.get_host_cpu_features().flatten().split(",")


@pytest.fixture(scope="module")
def products_for_cpus(tmp_path_factory):
    """(x, weights, {target: (folder, process)}): one process per target that runs here, all
    started at once. Each compiles the kernels for its own CPU, so they share no work, and the
    tests need not wait for one to finish before the next starts."""
    x = np.random.default_rng(1).standard_normal((13, 512)).astype(np.float32)
    weights = {encoding: random_weights(encoding, 37, 512)[0] for encoding in OTHER_CPU_ENCODINGS}
    root = Path(__file__).resolve().parent.parent
    jobs = {}
    for target in filter(runs_here, TARGET_DOTS):
        folder = tmp_path_factory.mktemp(f"cpu-{target}")
        np.save(folder / "x.npy", x)
        np.save(folder / "halves.npy", every_half())
        for encoding, w in weights.items():
            np.save(folder / f"{encoding}.npy", w)
        env = dict(os.environ, **target_environment(target), PYTHONPATH=str(root))
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            jobs[target] = folder, subprocess.Popen([sys.executable, "-c", PRODUCTS_FOR_CPU, *OTHER_CPU_ENCODINGS],
                                                    cwd=folder, env=env, stdout=out, stderr=err)
    yield x, weights, jobs
    for _, job in jobs.values():
        if job.poll() is None:
            job.kill()
        job.wait()


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGET_DOTS))
def test_kernels_built_for_other_cpus_match_the_native_ones(products_for_cpus, target):
    """The int8 kernels built for a CPU without AVX2 or F16C (portable vector IR), with AVX2
    only (no AVX-512: most users' CPUs), and with AVX-VNNI but no AVX-512 give the same
    products as the native ones: the
    unsigned x signed, signed x signed and K-quant integer dot products, table lookups and
    signed levels in Q8_K dots, for whole groups, a half group and single activations; and
    they convert every finite half exactly (vcvtph2ps, or integer steps without F16C)."""
    if not runs_here(target):
        pytest.skip("this CPU has no AVX-VNNI: kernels built for it cannot run here")
    x, weights, jobs = products_for_cpus
    folder, job = jobs[target]
    assert job.wait() == 0, (folder / "stderr").read_text()
    assert (folder / "stdout").read_text().strip().splitlines()[-1] == TARGET_DOTS[target]
    for encoding, w in weights.items():
        native = kernels.matmul(w, encoding, 37, 512, x)
        assert relative_error(np.load(folder / f"{encoding}-product.npy"), native) <= EXACT_TOLERANCE
    want = every_half().view(np.float16).astype(np.float32)
    assert np.array_equal(np.load(folder / "floats.npy").view(np.uint32), want.view(np.uint32))


def test_the_avx2_target_enables_nothing_a_zen_3_lacks():
    """The "avx2" build runs on an AVX2-only CPU: no AVX-512, AMX, AVX-VNNI, nor GFNI (which LLVM
    would otherwise use to shift bytes), whatever this host has."""
    features = target_environment("avx2")["NUMBA_CPU_FEATURES"].split(",")
    newer = ("avx512", "amx", "avx10", "avxvnni", "gfni")
    assert [f for f in features if f.startswith("+") and f[1:].startswith(newer)] == []
    assert ("+avx2" in features) == ("+avx2" in llvmlite.binding.get_host_cpu_features().flatten().split(","))


def reference_attention(q, keys, values, start):
    """float64 causal softmax attention with grouped KV heads."""
    n, heads, width = q.shape
    group = heads // keys.shape[1]
    out = np.zeros((n, heads, values.shape[2]))
    for i in range(n):
        for h in range(heads):
            k, v = keys[: start + i + 1, h // group].astype(np.float64), values[: start + i + 1, h // group].astype(np.float64)
            scores = k @ q[i, h] / np.sqrt(width)
            p = np.exp(scores - scores.max())
            out[i, h] = (p / p.sum()) @ v
    return out


@pytest.mark.parametrize("stored", [np.float32, np.float16])
# (300, 8) runs threaded; (0, 40) and (7, 300) take the prompt attention unless its copy of the cache is too large
@pytest.mark.parametrize("start, n", [(0, 1), (0, 7), (9, 1), (5, 4), (300, 8), (0, 40), (7, 300)])
@pytest.mark.parametrize("prompt_copy", ["fits", "too large"])
def test_attention_matches_float64_with_grouped_heads_and_a_causal_mask(stored, start, n, prompt_copy, monkeypatch):
    if prompt_copy == "too large":  # a prompt whose float32 copy of the cache would not fit: attention in place
        monkeypatch.setattr(kernels, "PROMPT_ATTENTION_BYTES", 0)
    rng = np.random.default_rng(start * 10 + n)
    heads, kv_heads, width, v_width = 8, 2, 64, 48
    q = rng.standard_normal((n, heads, width)).astype(np.float32)
    keys = rng.standard_normal((start + n, kv_heads, width)).astype(stored)
    values = rng.standard_normal((start + n, kv_heads, v_width)).astype(stored)
    as_kernel_reads = (lambda a: a.view(np.uint16)) if stored == np.float16 else (lambda a: a)
    got = kernels.attention(q, as_kernel_reads(keys), as_kernel_reads(values), start, width**-0.5)
    assert relative_error(got, reference_attention(q, keys, values, start)) < 1e-5


def windowed_attention(q, keys, values, start, first_key, window, sinks):
    """float64 attention where query i sees the `window` positions up to its own (0: all), a
    sink logit per head in the denominator; keys and values hold positions first_key.."""
    n, heads, width = q.shape
    group = heads // keys.shape[1]
    out = np.zeros((n, heads, values.shape[2]))
    for i in range(n):
        position = start + i
        lo = max(0, position - window + 1) if window else 0
        for h in range(heads):
            k = keys[lo - first_key:position + 1 - first_key, h // group].astype(np.float64)
            v = values[lo - first_key:position + 1 - first_key, h // group].astype(np.float64)
            scores = k @ q[i, h] / np.sqrt(width)
            top = max(scores.max(), sinks[h])
            p = np.exp(scores - top)
            out[i, h] = p @ v / (p.sum() + np.exp(sinks[h] - top))
    return out


# decode, threaded and prompt attention, each with the cache holding everything or only the window
@pytest.mark.parametrize("start, n", [(0, 1), (9, 1), (5, 4), (300, 8), (0, 40), (7, 300)])
@pytest.mark.parametrize("window", [0, 1, 6, 128])
@pytest.mark.parametrize("only_the_window", [False, True])
def test_attention_with_a_sliding_window_and_sinks_matches_float64(start, n, window, only_the_window):
    rng = np.random.default_rng(start * 10 + n + window)
    heads, kv_heads, width = 8, 2, 64
    first_key = max(0, start - window + 1) if window and only_the_window else 0
    q = rng.standard_normal((n, heads, width)).astype(np.float32)
    keys = rng.standard_normal((start + n - first_key, kv_heads, width)).astype(np.float32)
    values = rng.standard_normal((start + n - first_key, kv_heads, 48)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) * 2
    got = kernels.attention(q, keys, values, start, width**-0.5, window=window, sinks=sinks, first_key=first_key)
    assert relative_error(got, windowed_attention(q, keys, values, start, first_key, window, sinks)) < 1e-5


@pytest.mark.parametrize("start, n", [(0, 1), (9, 1), (5, 4), (300, 8), (0, 40), (7, 300)])
def test_attention_over_chosen_positions_matches_float64(start, n):
    """DeepSeek's sparse attention: each query attends to the positions `chosen` marks."""
    rng = np.random.default_rng(start + n)
    heads, width = 4, 64
    q = rng.standard_normal((n, heads, width)).astype(np.float32)
    keys = rng.standard_normal((start + n, 1, width)).astype(np.float16)
    chosen = (rng.random((n, start + n)) < 0.3).astype(np.uint8)
    chosen[np.arange(n), start + np.arange(n)] = 1  # a query attends to something
    got = kernels.attention(q, keys.view(np.uint16), keys.view(np.uint16)[:, :, :48], start, width**-0.5, chosen=chosen)
    want = np.zeros((n, heads, 48))
    for i in range(n):
        seen = np.nonzero(chosen[i, :start + i + 1])[0]
        k = keys[seen, 0].astype(np.float64)
        for h in range(heads):
            p = np.exp(k @ q[i, h] / np.sqrt(width) - (k @ q[i, h] / np.sqrt(width)).max())
            want[i, h] = p @ k[:, :48] / p.sum()
    assert relative_error(got, want) < 1e-5
    with pytest.raises(ValueError, match="does not fit"):
        kernels.attention(q, keys.view(np.uint16), keys.view(np.uint16), start, 0.1, chosen=chosen[:, 1:])


@pytest.mark.parametrize("stored", [np.float32, np.float16])
@pytest.mark.parametrize("queries, kv_heads", [(2, 2), (1, 1)], ids=["pairs", "heads"])
def test_decode_attention_gives_the_same_bits_on_one_thread_and_on_all(stored, queries, kv_heads, monkeypatch):
    """A query's attention does not depend on whether its work was large enough for all
    threads (the serial and the parallel kernel are two functions sharing one body), whether
    the threads share the (query, kv head) pairs or, with fewer pairs than threads (MLA's
    decoded token), each pair's heads: with a sliding window, a sink per head and values the
    keys' first columns, as MLA's."""
    rng = np.random.default_rng(4)
    rows, heads = 700, 10
    q = rng.standard_normal((queries, heads, 64)).astype(np.float32)
    keys = rng.standard_normal((rows, kv_heads, 64)).astype(stored)
    if stored == np.float16:
        keys = keys.view(np.uint16)
    sinks = rng.standard_normal(heads).astype(np.float32)
    attention_module = sys.modules[kernels.attention.__module__]
    results = []
    for work in (1, 1 << 62):
        monkeypatch.setattr(attention_module, "PARALLEL_ATTENTION_WORK", work)
        results.append(kernels.attention(q, keys, keys[:, :, :48], rows - queries, 0.125, window=500, sinks=sinks))
    threaded, alone = results
    assert np.array_equal(threaded.view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("stored", [np.float32, np.float16])
@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])
def test_attention_of_many_slots_gives_each_query_the_bits_of_its_own_cache(stored, latent):
    """A batch step's one call over every sequence's slot (GQA with sinks, or MLA's values as
    the first part of each key) gives what `attention` gives each query over its own cache."""
    rng = np.random.default_rng(8)
    slots, rows, heads, kv_heads, width = 5, 40, 8, 1 if latent else 2, 80 if latent else 32
    pool = rng.standard_normal((slots, rows, kv_heads, width)).astype(stored)
    if stored == np.float16:
        pool = pool.view(np.uint16)
    keys = pool
    values = pool[:, :, :, :64] if latent else rng.standard_normal(pool.shape).astype(stored).view(pool.dtype)
    which, positions = np.array([3, 0, 4, 1], np.int64), np.array([39, 0, 17, 5], np.int64)
    q = rng.standard_normal((which.size, heads, width)).astype(np.float32)
    sinks = None if latent else rng.standard_normal(heads).astype(np.float32)
    out = np.empty((which.size, heads, values.shape[3]), np.float32)
    kernel_sinks = np.full(heads, kernels.NO_SINK, np.float32) if sinks is None else sinks
    kernels.attention_of_slots(q, keys, values, which, positions, kernels.Scoring(kernel_sinks, np.float32(0.1)), out)
    for i, (slot, position) in enumerate(zip(which, positions)):
        end = position + 1
        alone = kernels.attention(q[i:i + 1], keys[slot, :end], values[slot, :end], int(position), 0.1, sinks=sinks)
        assert np.array_equal(out[i:i + 1].view(np.uint32), alone.view(np.uint32)), i


def test_attention_refuses_a_cache_that_lacks_positions_the_window_sees():
    q = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(ValueError, match="after the first one"):
        kernels.attention(q, np.zeros((3, 2, 16), np.float32), np.zeros((3, 2, 16), np.float32), 9, 0.25,
                          window=5, first_key=7)


def test_attention_refuses_a_cache_that_does_not_fit_the_queries():
    q = np.zeros((2, 4, 16), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.attention(q, np.zeros((3, 2, 16), np.float32), np.zeros((3, 2, 16), np.float32), 0, 0.25)


def test_rms_norm_matches_float64():
    x = np.random.default_rng(3).standard_normal((3, 5, 96)).astype(np.float32)
    weight = np.random.default_rng(4).standard_normal(96).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * weight
    assert relative_error(kernels.rms_norm(x, weight, 1e-6), want) < 1e-6


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_per_head_products_use_each_heads_rows(exact):
    heads, rows, stride, first, cols = 3, 5, 8, 2, 256
    w, reference = random_weights("Q8_0", first + heads * stride, cols)
    x = np.random.default_rng(5).standard_normal((2 * heads, cols)).astype(np.float32)  # 2 tokens × 3 heads
    got = kernels.Matrix(w, "Q8_0", first + heads * stride, cols, exact).times_per_head(x, heads, rows, stride, first)
    want = np.stack([reference[first + (g % heads) * stride:][:rows] @ x[g] for g in range(2 * heads)])
    assert got.shape == (2 * heads, rows)
    assert relative_error(got, want) <= (EXACT_TOLERANCE if exact else kernels.FAST_PATH_TOLERANCE)


def reference_route(logits, bias, k, sigmoid, groups, topk_groups, top2_sum, norm, scale):
    """Routing written with numpy sorts (transformers' formulation)."""
    scores = 1 / (1 + np.exp(-logits)) if sigmoid else np.exp(logits - logits.max(-1, keepdims=True))
    scores = scores if sigmoid else scores / scores.sum(-1, keepdims=True)
    choice = scores + (bias if bias is not None else 0)
    if groups > 1:
        grouped = choice.reshape(len(logits), groups, -1)
        group_scores = np.sort(grouped, -1)[..., -2:].sum(-1) if top2_sum else grouped.max(-1)
        keep = np.argsort(-group_scores, -1, kind="stable")[:, :topk_groups]
        dropped = np.ones(group_scores.shape, bool)
        np.put_along_axis(dropped, keep, False, -1)
        choice = np.where(np.repeat(dropped, grouped.shape[-1], -1), -np.inf, choice)
    ids = np.argsort(-choice, -1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, -1)
    if norm:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if sigmoid else 0))
    return ids, weights * scale


# (k, sigmoid, bias, groups, topk_groups, top2_sum, norm, scale): Mixtral, Qwen3-MoE, DeepSeek-V3, DeepSeek-V2
ROUTERS = [(2, False, False, 1, 1, True, True, 1.0), (8, False, False, 1, 1, True, False, 1.0),
           (8, True, True, 8, 4, True, True, 2.5), (6, False, False, 8, 3, False, False, 16.0)]


@pytest.mark.parametrize("k, sigmoid, biased, groups, topk_groups, top2_sum, norm, scale", ROUTERS,
                         ids=["mixtral", "qwen3", "deepseek-v3", "deepseek-v2"])
def test_route_matches_a_numpy_formulation(k, sigmoid, biased, groups, topk_groups, top2_sum, norm, scale):
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((50, 64)).astype(np.float32)
    logits[0, 10] = logits[0, 20] = 9.0  # a tie: the lower id goes first
    bias = rng.standard_normal(64).astype(np.float32) * 0.1 if biased else None
    ids, weights = kernels.route(logits, bias, k, sigmoid, groups, topk_groups, top2_sum, norm, scale)
    want_ids, want_weights = reference_route(logits.astype(np.float64), bias, k, sigmoid, groups, topk_groups,
                                             top2_sum, norm, scale)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5)
    assert weights.dtype == np.float32
    if groups == 1:
        assert ids[0, :2].tolist() == [10, 20]
    for i in (0, 17, 49):  # many rows share the threads, a row alone runs on one: the same bits
        alone = kernels.route(logits[i:i + 1], bias, k, sigmoid, groups, topk_groups, top2_sum, norm, scale)
        assert np.array_equal(alone[0][0], ids[i])
        assert np.array_equal(alone[1][0].view(np.uint32), weights[i].view(np.uint32))


@pytest.mark.parametrize("encodings, ffn, hidden, exact", [e for e in EXPERTS if not e[3]],
                         ids=["-".join(e[0]) for e in EXPERTS if not e[3]])
@pytest.mark.parametrize("n", [2, 5, 40])
def test_grouped_experts_equal_the_per_expert_path(encodings, ffn, hidden, exact, n, monkeypatch):
    """All of a layer's (expert, rows) groups in one call give, to the bit, what the per-expert
    path gives: each expert's batch product of its rows, added to their sums in expert order;
    also when the call takes its rows a few at a time (groups cut between those too)."""
    from colibri.runtime.kernels import experts as expert_kernels
    from colibri.runtime.kernels.activations import make_activation

    k, experts = 2, 4
    records, offsets, _ = expert_records(encodings, ffn, hidden, experts)
    kernel = kernels.ExpertKernel(records.shape[1], encodings, offsets, ffn, hidden)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(experts, k, replace=False, p=[0.7, 0.1, 0.1, 0.1]) for _ in range(n)])  # one busy expert
    weights = rng.random((n, k)).astype(np.float32)
    acts = {dot_type: make_activation(x, dot_type, tiles=False) for dot_type in set(kernel.dot_types[:2])}
    if None in kernel.dot_types:  # float weights multiply float activations, expert by expert
        assert not kernel.groupable(acts)
        return
    want = np.zeros_like(x)
    with kernels.without_amx():  # int8 all through, as `grouped` (on AMX, batch tiles the down rows)
        for expert in np.unique(ids):
            rows, choice = np.nonzero(ids == expert)
            y = kernel.batch(records[expert], kernel.rows_of(acts, rows), rows.size, expert)
            kernels.add_weighted_rows(want, rows, y, weights[rows, choice])
    order = np.argsort(ids.reshape(-1), kind="stable")
    used, starts = np.unique(ids.reshape(-1)[order], return_index=True)
    # the rows shared out so that groups are cut between threads; then at most 9 rows (or a
    # GROUP) a call
    for parts, chunk_rows in ((1, None), (2, None), (3, None), (7, None), (2, 9), (3, 1)):
        if chunk_rows:
            monkeypatch.setattr(expert_kernels, "GROUPED_ROW_BYTES", 4 * hidden * chunk_rows)
        got = np.zeros_like(x)
        kernel.grouped(records, used.astype(np.int64), np.append(starts, order.size).astype(np.int64),
                       (order // k).astype(np.int64), weights.reshape(-1)[order], acts, got, used.astype(np.int64),
                       parts=parts)
        assert kernel.groupable(acts) and np.array_equal(got.view(np.uint32), want.view(np.uint32)), (parts, chunk_rows)


def clamped_expert_reference(matrices, biases, x, alpha, limit):
    """gpt-oss's expert in float64: gate and up with their biases, the clamped SwiGLU, down
    with its bias."""
    gate, up, down = matrices
    g, u = x @ gate.T + biases[0], x @ up.T + biases[1]
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return ((u + 1) * g / (1 + np.exp(-alpha * g))) @ down.T + biases[2]


@pytest.mark.parametrize("encodings", [("MXFP4", "MXFP4", "MXFP4"), ("Q8_0", "Q8_0", "Q8_0")])
def test_clamped_swiglu_experts_with_biases_match_reference_on_every_path(encodings):
    ffn, hidden, experts, alpha, limit = 64, 128, 5, 1.702, 0.5  # products of ~1: about half are clipped
    records, offsets, matrices = expert_records(encodings, ffn, hidden, experts)
    rng = np.random.default_rng(11)
    biases = tuple(rng.standard_normal((experts, cols)).astype(np.float32) * 0.02 for cols in (ffn, ffn, hidden))
    activation = dict(glu="clamped_swiglu", alpha=alpha, limit=limit, biases=biases)
    slots, ids = np.array([0, 1, 2]), np.array([4, 0, 3])  # the records of experts 4, 0 and 3
    x = rng.standard_normal(hidden).astype(np.float32) * 0.1
    weights = rng.random(3).astype(np.float32)
    chosen = [(matrices[s], [b[e] for b in biases]) for s, e in zip(slots, ids)]
    want = sum(w * clamped_expert_reference(m, b, x.astype(np.float64), alpha, limit) for w, (m, b) in zip(weights, chosen))
    got = kernels.moe_experts(records, encodings, offsets, ffn, hidden, x, weights, slots=slots, ids=ids, **activation)
    assert relative_error(got, want) <= 2 * kernels.FAST_PATH_TOLERANCE
    xs = rng.standard_normal((6, hidden)).astype(np.float32) * 0.1
    y = kernels.moe_experts_batch(records[1], encodings, offsets, ffn, hidden, xs, expert=0, **activation)
    assert relative_error(y, clamped_expert_reference(matrices[1], [b[0] for b in biases], xs.astype(np.float64),
                                                      alpha, limit)) <= 2 * kernels.FAST_PATH_TOLERANCE
    kernel = kernels.ExpertKernel(records.shape[1], encodings, offsets, ffn, hidden, **activation)
    acts = kernel.activations(xs)
    grouped = np.zeros_like(xs)  # rows 0-2 to expert 4 (slot 0), rows 3-5 to expert 0 (slot 1)
    kernel.grouped(records, np.array([0, 1]), np.array([0, 3, 6]), np.arange(6), np.ones(6, np.float32), acts, grouped,
                   np.array([4, 0]))
    assert np.array_equal(grouped[3:], y[3:])
    with pytest.raises(ValueError, match="out of range"):
        kernels.moe_experts(records, encodings, offsets, ffn, hidden, x, weights, slots=slots, ids=[4, 0, 5], **activation)


@pytest.mark.parametrize("encoding", [e for e in ENCODINGS if e in kernels.FAST_ENCODINGS])
def test_ggml_blocks_decode_as_ggml_does(encoding):
    """Blocks ggml's quantizer made (tests/data, every case): our dequantization is ggml's
    `dequantize_row_<type>` bit for bit, and both product paths are close to it."""
    with np.load(GOLDEN_ALL) as golden:
        cases = sorted({k.split("/")[0] for k in golden.files})
        for case in cases:
            plain = f"{case}/{encoding}"
            w = golden[plain] if plain in golden.files else golden[f"{plain}+imatrix"]
            want = golden[f"{case}/{encoding}/dequant"]
            rows, cols = want.shape
            assert np.array_equal(kernels.dequantize_rows(w.reshape(-1), encoding, cols, 0, rows), want), case
            x = np.random.default_rng(0).standard_normal((3, cols)).astype(np.float32)
            reference = x.astype(np.float64) @ want.T.astype(np.float64)
            for exact in (False, True):
                got = kernels.matmul(w.reshape(-1), encoding, rows, cols, x, exact=exact)
                bound = kernels.FAST_PATH_TOLERANCE if not exact else EXACT_TOLERANCE
                assert relative_error(got, reference) <= bound, (case, exact)


@pytest.mark.parametrize("tiled", [False, True])
def test_gated_delta_rule_matches_the_recurrence_written_out(tiled):
    """transformers' torch_recurrent_gated_delta_rule, token by token in float64, for two key
    heads serving four value heads in either order, with a decay per key channel (Kimi delta
    attention's; a gated DeltaNet's is one value repeated)."""
    rng = np.random.default_rng(4)
    n, k_heads, v_heads, dk, dv = 9, 2, 4, 8, 16
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(rng.standard_normal((n, k_heads, dk))), unit(rng.standard_normal((n, k_heads, dk)))
    v = rng.standard_normal((n, v_heads, dv))
    decay, beta = rng.uniform(0.3, 1.0, (n, v_heads, dk)), rng.uniform(0.0, 1.0, (n, v_heads))
    key_heads = np.array([h % k_heads if tiled else h // 2 for h in range(v_heads)], np.int64)
    start = rng.standard_normal((v_heads, dk, dv))
    state, want = start.copy(), np.empty((n, v_heads, dv))
    for t in range(n):
        for h, g in enumerate(key_heads):
            state[h] *= decay[t, h][:, None]
            delta = (v[t, h] - state[h].T @ k[t, g]) * beta[t, h]
            state[h] += np.outer(k[t, g], delta)
            want[t, h] = state[h].T @ q[t, g]
    f32 = lambda x: np.ascontiguousarray(x, np.float32)  # noqa: E731
    got, out_state = np.empty((n, v_heads, dv), np.float32), f32(start)
    kernels.gated_delta_rule(f32(q), f32(k), f32(v), f32(decay), f32(beta), key_heads, out_state, got)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(out_state - state).max() <= 1e-5 * np.abs(state).max()


def test_grouped_rows_split_at_whole_groups_of_activations():
    """The grouped kernel cuts the rows between threads at GROUP multiples from a group's start
    (or at its end), in order, covering every row once."""
    from colibri.runtime.kernels.experts import _split_row
    from colibri.runtime.kernels.rows import GROUP

    starts = np.array([0, 3, 3, 40, 41, 100], np.int64)
    cuts = [_split_row(starts, row) for row in range(101)]
    assert cuts[0] == 0 and cuts[100] == 100 and cuts == sorted(cuts)
    for cut in cuts:
        g = np.searchsorted(starts, cut, side="right") - 1
        assert cut == 100 or (cut - starts[g]) % GROUP == 0  # a group's end is the next one's start
    assert _split_row(starts, 3 + GROUP // 2) == 3 + GROUP and _split_row(starts, 3 + GROUP // 2 - 1) == 3
