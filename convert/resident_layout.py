"""Write the resident file as the colibri layout stores it.

Every tensor that is not a routed expert, back to back, each starting at a multiple of 64
(the gaps zeros), each with a sha256. The source does not matter: the caller passes, per
tensor, its canonical name, encoding, shape and its encoded bytes as an iterable of
chunks in order, so a huge embedding never has to be in memory at once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from colibri.formats.encodings import tensor_bytes
from colibri.formats.layout import RESIDENT_FILE, TENSOR_ALIGN, AlignedFileWriter, align_up


class ResidentTensorData(NamedTuple):
    name: str  # canonical (gguf) name
    encoding: str
    shape: tuple[int, ...]
    chunks: Iterable  # the encoded bytes in order (bytes-like or uint8 arrays)
    source_bytes: int  # reported to `advance` once the tensor is written


def resident_file_bytes(tensors: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes the resident file takes for (encoding, shape) tensors, each at a 64-byte boundary
    (at most: the file does not pad after its last tensor)."""
    return sum(align_up(tensor_bytes(encoding, shape), TENSOR_ALIGN) for encoding, shape in tensors)


def write_resident_file(out_dir: Path, tensors: Iterable[ResidentTensorData], advance: Callable[[int], None]) -> dict:
    """Write `resident.bin` atomically; return its manifest fragment (`tensors`, `files`)."""
    writer = AlignedFileWriter(Path(out_dir) / RESIDENT_FILE)
    entries = {}
    try:
        for tensor in tensors:
            offset = writer.start(TENSOR_ALIGN)
            digest = hashlib.sha256()
            for chunk in tensor.chunks:
                writer.write(chunk)
                digest.update(chunk)
            entries[tensor.name] = {
                "file": RESIDENT_FILE, "offset": offset, "nbytes": writer.size - offset, "encoding": tensor.encoding,
                "shape": list(tensor.shape), "sha256": digest.hexdigest(),
            }
            advance(tensor.source_bytes)
        size = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"tensors": entries, "files": {RESIDENT_FILE: {"size": size}}}
