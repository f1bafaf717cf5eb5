"""The AMX tile path of the kernels (runtime/amx.py): prompts of at least amx.MIN_TOKENS rows
multiply bfloat16-rounded weights and activations on the tiles of CPUs that have them.

Against float64 products of gguf's decoding, to TILE_TOLERANCE of the output's max-abs; the
int8 path takes over when the CPU has no tiles or COLIBRI_AMX=0. On a CPU without AMX the
tests of the tile path are skipped (the int8 path is what runs there, and test_kernels.py
covers it).
"""

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from colibri.runtime import amx, kernels
from colibri.runtime.kernels.activations import activation_rows
from tests.test_kernels import expert_records, expert_reference, random_weights, relative_error

# bfloat16 keeps 8 bits of each weight and activation; measured: at most 3e-3 on these cases
TILE_TOLERANCE = 5e-3
needs_tiles = pytest.mark.skipif(not amx.available(), reason="this CPU (or kernel) gives no AMX tiles")
ROWS = 70  # two whole blocks of 32 rows and a part of one


@needs_tiles
@pytest.mark.parametrize("encoding, cols", [("Q4_K", 2048), ("Q5_K", 512), ("Q6_K", 1280), ("Q8_0", 288),
                                            ("Q5_0", 1056), ("Q5_1", 288)])
def test_tile_products_match_float64(encoding, cols):
    w, reference = random_weights(encoding, ROWS, cols)
    x = np.random.default_rng(3).standard_normal((70, cols)).astype(np.float32)
    matrix = kernels.Matrix(w, encoding, ROWS, cols)
    for n in (amx.MIN_TOKENS, 17, 32, 33, 70):  # one tile of tokens, parts of a block, several blocks
        act = matrix.activation(x[:n])
        assert isinstance(act, amx.TileActivation)
        y = matrix.times(act, n)
        assert y.dtype == np.float32 and y.shape == (n, ROWS)
        assert relative_error(y, x[:n].astype(np.float64) @ reference.T) <= TILE_TOLERANCE


@needs_tiles
def test_tiles_serve_prompts_and_int8_serves_fewer_tokens_and_the_exact_path():
    w, _ = random_weights("Q4_K", ROWS, 256)
    x = np.zeros((amx.MIN_TOKENS, 256), np.float32)
    matrix = kernels.Matrix(w, "Q4_K", ROWS, 256)
    assert isinstance(matrix.activation(x), amx.TileActivation)
    assert isinstance(matrix.activation(x[:-1]), kernels.Q8_KActivation)
    assert isinstance(kernels.Matrix(w, "Q4_K", ROWS, 256, exact=True).activation(x), np.ndarray)


@needs_tiles
def test_one_packing_serves_every_matrix_and_gathered_rows():
    w, reference = random_weights("Q6_K", ROWS, 256)
    x = np.random.default_rng(4).standard_normal((40, 256)).astype(np.float32)
    act = kernels.Matrix(w, "Q6_K", ROWS, 256).activation(x)
    assert act.packed is act.packed
    rows = np.array([3, 5, 8, 13, 21, 34, 1, 2, 0, 39, 38, 37, 36, 35, 30, 31, 20])
    y = kernels.Matrix(w, "Q6_K", ROWS, 256).times(activation_rows(act, rows), rows.size)
    assert relative_error(y, x[rows].astype(np.float64) @ reference.T) <= TILE_TOLERANCE


@needs_tiles
def test_tile_results_do_not_depend_on_the_thread_count():
    w, _ = random_weights("Q4_K", ROWS, 1024)
    x = np.random.default_rng(5).standard_normal((48, 1024)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            kernels.set_threads(threads)
            results.append(kernels.matmul(w, "Q4_K", ROWS, 1024, x))
    finally:
        kernels.set_threads(before)
    np.testing.assert_array_equal(*results)


@needs_tiles
def test_an_expert_applied_to_a_prompt_on_tiles_matches_float64():
    records, offsets, matrices = expert_records(("Q4_K", "Q4_K", "Q6_K"), 512, 768, 1)
    x = np.random.default_rng(6).standard_normal((40, 768)).astype(np.float32)
    y = kernels.moe_experts_batch(records[0], ("Q4_K", "Q4_K", "Q6_K"), offsets, 512, 768, x)
    want = expert_reference(matrices[0], x.astype(np.float64))
    assert relative_error(y, want) <= TILE_TOLERANCE


def test_colibri_amx_0_turns_the_tiles_off(tmp_path):
    code = ("import numpy as np; from colibri.runtime import amx, kernels; "
            "x = np.zeros((64, 256), np.float32); "
            "print(amx.available(), type(kernels.Matrix(np.zeros(64 * 144, np.uint8), 'Q4_K', 64, 256).activation(x)).__name__)")
    env = {**os.environ, "COLIBRI_AMX": "0"}
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, env=env,
                            capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "Q8_KActivation"]
