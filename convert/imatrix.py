"""Importance matrices: `llama-imatrix`'s GGUF files, for ggml's weighted quantizers.

An entry `NAME.in_sum2` (F32 [matrices, row length]: the sum of the squared activations each
weight column saw, per expert for an expert tensor) with `NAME.counts` (F32 [matrices, 1]: how
many activations) gives the importance of the columns of tensor NAME as in_sum2 / count, as
llama-quantize computes it (1 where a matrix saw nothing). NAME is the gguf tensor name, which
is also our canonical name. The file is read through the strict GGUF reader of the import,
whose memory map serves each entry when a tensor asks for it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from colibri.convert.gguf_source import GGUFError, field_value, open_reader, tensor_table
from colibri.convert.pipeline import ConvertError

SUMS, COUNTS = ".in_sum2", ".counts"
MAX_DATASETS, MAX_DATASET_NAME = 8, 200  # of the dataset names a manifest records


class ImatrixError(ConvertError):
    """An importance matrix that cannot be used; the message names the file."""


class Imatrix:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            reader = open_reader(self.path)
            kind = field_value(reader, "general.type")
            datasets = field_value(reader, "imatrix.datasets")
            tensors = {t.name: t for t in tensor_table(self.path, reader)}
        except GGUFError as e:
            raise ImatrixError(f"--imatrix {e}") from None
        self.data = reader.data.view(np.ndarray)  # the reader's read-only map of the whole file
        if kind != "imatrix":
            raise ImatrixError(f"--imatrix {self.path.name}: not an importance matrix (general.type is {kind!r}; "
                               "llama-imatrix's GGUF output is expected)")
        # the texts it was computed from, as llama-imatrix records them (names, at most a few)
        self.datasets = [str(d)[:MAX_DATASET_NAME] for d in datasets[:MAX_DATASETS]] if isinstance(datasets, list) else []
        self.entries = {}
        for name, sums in tensors.items():
            if not name.endswith(SUMS):
                continue
            base = name[:-len(SUMS)]
            counts = tensors.get(base + COUNTS)
            if sums.type != "F32" or len(sums.shape) != 2 or counts is None or counts.type != "F32" \
                    or counts.shape != (sums.shape[0], 1):
                raise ImatrixError(f"--imatrix {self.path.name}: {base} needs F32 {SUMS} [matrices, row] and "
                                   f"{COUNTS} [matrices, 1], got {sums.type} {list(sums.shape)} and "
                                   f"{'none' if counts is None else f'{counts.type} {list(counts.shape)}'}")
            self.entries[base] = (sums, counts)
        if not self.entries:
            raise ImatrixError(f"--imatrix {self.path.name}: holds no {SUMS} entries")

    def sha256(self) -> str:
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
        return digest.hexdigest()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def importance(self, name: str, row: int, matrix: int = 0) -> np.ndarray | None:
        """float32 [row]: the importance of the columns of `name` (of expert `matrix` of an
        expert tensor), or None when the file has no entry for it."""
        if name not in self.entries:
            return None
        sums, counts = self.entries[name]
        matrices, length = sums.shape
        if length != row or not (matrices == 1 or matrix < matrices):
            raise ImatrixError(f"--imatrix {self.path.name}: {name} has {matrices} matrices of {length} columns; "
                               f"the model's has rows of {row}" + (f" and expert {matrix}" if matrices > 1 else ""))
        index = matrix if matrices > 1 else 0
        start = sums.offset + 4 * length * index
        values = self.data[start:start + 4 * length].view("<f4").astype(np.float32)
        count = self.count(name, index)
        if not np.isfinite(values).all() or (values < 0).any():
            raise ImatrixError(f"--imatrix {self.path.name}: {name} holds a negative or non-finite value")
        return values / count if count > 0 else np.ones(length, np.float32)

    def count(self, name: str, matrix: int = 0) -> float:
        """How many activations entered `name` (its expert `matrix`) while it was collected."""
        _, counts = self.entries[name]
        index = min(matrix, counts.shape[0] - 1)
        count = float(self.data[counts.offset + 4 * index:counts.offset + 4 * index + 4].view("<f4")[0])
        if not np.isfinite(count) or count < 0:
            raise ImatrixError(f"--imatrix {self.path.name}: {name} holds a negative or non-finite count")
        return count


def imatrix_record(imatrix: Imatrix) -> str:
    """What a manifest records of the importance matrix a conversion used: file, sha256, texts."""
    texts = f" text={','.join(imatrix.datasets)}" if imatrix.datasets else ""
    return f"{imatrix.path.name} sha256={imatrix.sha256()}{texts}"
