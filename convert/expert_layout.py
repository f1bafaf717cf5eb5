"""Write one MoE layer's routed experts as the colibri layout stores them.

Expert `e` is one record at `offset + e * stride`: its gate, up and down matrices
back to back (so a single read fetches the expert), the stride a multiple of 4096
(so every expert starts on a page boundary and O_DIRECT reads are possible), the
padding zeros. Each expert's record gets a sha256. The source layout does not matter:
the caller passes a function that returns expert `e`'s three encoded matrices.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from colibri.formats.encodings import tensor_bytes
from colibri.formats.layout import EXPERT_ALIGN, EXPERT_MATRICES, AlignedFileWriter, align_up, expert_file_name


def expert_matrix_table(encodings: dict[str, str], shapes: dict[str, tuple[int, int]]) -> tuple[dict, int]:
    """The manifest's per-matrix entries (offsets within an expert) and the expert's size."""
    table, offset = {}, 0
    for m in EXPERT_MATRICES:
        nbytes = tensor_bytes(encodings[m], shapes[m])
        table[m] = {"encoding": encodings[m], "shape": list(shapes[m]), "offset": offset, "nbytes": nbytes}
        offset += nbytes
    return table, offset


def expert_file_bytes(encodings: dict[str, str], shapes: dict[str, tuple[int, int]], count: int) -> int:
    """Bytes of a layer's expert file: `count` records, each padded to the 4096-byte stride."""
    _, expert_bytes = expert_matrix_table(encodings, shapes)
    return align_up(expert_bytes, EXPERT_ALIGN) * count


def write_expert_layer(
    out_dir: Path,
    layer: int,
    count: int,
    encodings: dict[str, str],
    shapes: dict[str, tuple[int, int]],
    encode_expert: Callable[[int], Sequence[np.ndarray]],
    on_expert: Callable[[int], None] = lambda e: None,
) -> dict:
    """Write `experts/blk.LLL.bin` atomically; return its `expert_layers` manifest entry."""
    matrices, expert_bytes = expert_matrix_table(encodings, shapes)
    stride = align_up(expert_bytes, EXPERT_ALIGN)
    file = expert_file_name(layer)
    writer = AlignedFileWriter(Path(out_dir) / file)
    checksums = []
    try:
        for e in range(count):
            blocks = [np.ascontiguousarray(b).view(np.uint8).reshape(-1) for b in encode_expert(e)]
            sizes = [b.nbytes for b in blocks]
            if sizes != [matrices[m]["nbytes"] for m in EXPERT_MATRICES]:
                raise ValueError(f"layer {layer} expert {e}: encoded sizes {sizes} do not match the table")
            start = writer.start(EXPERT_ALIGN)
            assert start == e * stride
            digest = hashlib.sha256()
            for block in blocks:
                writer.write(block)
                digest.update(block)
            checksums.append(digest.hexdigest())
            on_expert(e)
        writer.pad_to(EXPERT_ALIGN)
        size = writer.commit()
    except BaseException:
        writer.abort()
        raise
    entry = {
        "layer": layer, "file": file, "offset": 0, "stride": stride, "count": count,
        "expert_bytes": expert_bytes, "matrices": matrices, "sha256": checksums,
    }
    return {"expert_layer": entry, "files": {file: {"size": size}}}
