"""Importance matrices from our own runtime, as `llama-imatrix` collects them.

While text runs through the model, every matrix of a layer (`blk.*`, and DeepSeek-V4's head
mixing `output_hc_fn`) adds the squares of
the activations it multiplies to a per-column sum, and counts the activations; a routed
expert tensor keeps one sum and one count per expert, over the rows routed to that expert.
The down projection of an expert sees the SwiGLU of its gate and up products, which the
runtime's expert kernels compute inside one call, so it is recomputed here for the rows of
each expert. The file is llama-imatrix's GGUF (`NAME.in_sum2`, `NAME.counts`, the dataset
and chunk keys), which `colibri-convert --imatrix` and `llama-quantize --imatrix` read.

The matrices our attention multiplies per head report what they multiply themselves: MLA's
`attn_kv_b` the normalized latent, DeepSeek-V4's grouped `attn_output_a` every group's heads,
pooled (one sum per column, as llama-quantize reads it for the 2-D tensor). Not collected:
`output.weight` (llama-imatrix skips it by default too).
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from colibri.runtime import kernels
from colibri.runtime.model import MoE

EXPERT_MATRICES = ("gate", "up", "down")
OBSERVED = ("blk.", "output_hc_")  # the layers' matrices and DeepSeek-V4's head mixing (not output.weight)


class ActivationSums:
    """Per tensor name: float64 sums of squared activations [matrices, columns] and counts [matrices]."""

    def __init__(self):
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}

    def add(self, name: str, x: np.ndarray, matrix: int = 0, matrices: int = 1) -> None:
        if name not in self.sums:
            self.sums[name] = np.zeros((matrices, x.shape[-1]))
            self.counts[name] = np.zeros(matrices, np.int64)
        x = x.reshape(-1, x.shape[-1]).astype(np.float64)
        if not np.isfinite(x).all():
            raise ValueError(f"non-finite activations enter {name}")
        self.sums[name][matrix] += np.einsum("ij,ij->j", x, x)
        self.counts[name][matrix] += x.shape[0]

    def attach(self, model) -> None:
        """Observe every `OBSERVED` matrix and MoE layer of an open model's decoder."""
        decoder = model.decoder
        for name, matrix in decoder.weights.matrices.items():
            if name.startswith(OBSERVED):
                matrix.observe = lambda x, name=name: self.add(name, x)
        for *_, ffn in decoder.layers:
            if isinstance(ffn, MoE):
                ffn.observe = self.add_experts

    def add_experts(self, moe: MoE, h: np.ndarray, ids: np.ndarray) -> None:
        """The rows of h [n, hidden] routed to each expert by `ids` [n, k], into that expert's
        gate, up and down sums."""
        store, table = moe.store, moe.store.tables[moe.layer]
        names = {m: f"blk.{moe.layer}.ffn_{m}_exps.weight" for m in EXPERT_MATRICES}
        rule = moe.experts.rule
        glu = kernels.GLU(rule.glu, rule.alpha, rule.limit)  # what the experts' down multiplies
        for expert in np.unique(ids):
            rows = np.flatnonzero((ids == expert).any(axis=1))
            x = h[rows]
            record = store.records(moe.layer)[store.fetch(moe.layer, np.array([expert]))[0]]
            gate, up = (expert_matrix(record, table.matrices[m]) for m in ("gate", "up"))
            for m, seen in (("gate", x), ("up", x), ("down", kernels.glu_times(gate(x), up(x), glu))):
                self.add(names[m], seen, int(expert), table.count)

    def write(self, path: Path, datasets: list[str], chunk_count: int, chunk_size: int) -> None:
        """llama-imatrix's GGUF at `path` (written beside it and renamed: never half a file)."""
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        writer = gguf.GGUFWriter(partial, arch=None)
        writer.add_string("general.type", "imatrix")
        writer.add_array("imatrix.datasets", datasets)
        writer.add_uint32("imatrix.chunk_count", chunk_count)
        writer.add_uint32("imatrix.chunk_size", chunk_size)
        for name in sorted(self.sums):
            writer.add_tensor(name + ".in_sum2", self.sums[name].astype(np.float32))
            writer.add_tensor(name + ".counts", self.counts[name].astype(np.float32).reshape(-1, 1))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)


def expert_matrix(record: np.ndarray, info) -> kernels.Matrix:
    """Matrix `info` (a layout expert matrix: encoding, offset, nbytes, shape) of an expert record."""
    return kernels.Matrix(record[info.offset:info.offset + info.nbytes], info.encoding, *info.shape)
