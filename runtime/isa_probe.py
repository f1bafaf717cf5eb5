"""A worker of `isa_choice`: one token times samples of a model's matrices, timed in a process
whose kernels numba compiles for one target (the NUMBA_CPU_NAME / NUMBA_CPU_FEATURES it was
started with).

    python -m colibri.runtime.isa_probe MODEL --threads N

It copies up to `isa_choice.SAMPLE_BYTES` of each kind of matrix into RAM and multiplies one
token by each sample once (numba compiles the kernels), then prints `{"ready": true}`. Each line
`time` on stdin then makes it print one JSON line: per kind, the bytes of its sample and the
fastest of PASSES passes over it, in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import chain

import numpy as np

from colibri.formats.encodings import row_bytes
from colibri.formats.layout import ModelLayout
from colibri.runtime import kernels
from colibri.runtime.isa_choice import SAMPLE_BYTES, MatrixKind, matrix_kinds

PASSES = 5


def _sources_data(layout: ModelLayout, source: tuple):
    """The encoded bytes of each matrix a source names: a tensor, or each expert's matrix of a layer."""
    if source[0] == "tensor":
        yield layout.tensor_data(source[1])
        return
    _, layer, name = source
    for expert in range(layout.expert_layers[layer].count):
        yield layout.expert_matrix_data(layer, expert, name)


def sample(layout: ModelLayout, kind: MatrixKind) -> kernels.Matrix:
    """Whole rows of the kind's matrices, up to SAMPLE_BYTES, copied into one matrix in RAM."""
    per_row = row_bytes(kind.encoding, kind.cols)
    room = SAMPLE_BYTES // per_row  # rows the sample holds
    parts, rows = [], 0
    for data in chain.from_iterable(_sources_data(layout, source) for source in kind.sources):
        take = min(len(data) // per_row, room - rows)
        parts.append(np.array(data[: take * per_row]))
        rows += take
        if rows == room:
            break
    return kernels.Matrix(np.concatenate(parts), kind.encoding, rows, kind.cols)


def fastest_pass(matrix: kernels.Matrix, activation) -> float:
    best = float("inf")
    for _ in range(PASSES):
        start = time.perf_counter()
        matrix.times(activation, 1)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    kernels.set_threads(args.threads)
    layout = ModelLayout(args.model)
    rng = np.random.default_rng(0)
    with kernels.decoding_alone():
        samples = {}
        for kind in matrix_kinds(layout):
            matrix = sample(layout, kind)
            samples[kind.key] = matrix, matrix.activation(rng.standard_normal((1, kind.cols)).astype(np.float32))
            matrix.times(samples[kind.key][1], 1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "time":
            break
        print(json.dumps({key: {"bytes": int(m.data.nbytes), "seconds": fastest_pass(m, act)} for key, (m, act) in samples.items()}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
