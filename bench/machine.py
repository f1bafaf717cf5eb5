"""What the benchmarks measure the machine with: its read bandwidth, and a cold page cache.

Imported by the scripts beside it (a script's own folder is first on sys.path).
"""

from __future__ import annotations

import os
from pathlib import Path

from colibri.formats.layout import ModelLayout


def read_bandwidth(threads: int) -> float:
    """Bytes/s a numba read on `threads` threads reaches (bench/kernel_speed.py's measure)."""
    from kernel_speed import memory_bandwidth

    return memory_bandwidth(1 << 30, 5, [threads])[f"read_{threads}t_gbs"] * 1e9


def evict(path: Path) -> None:
    """Drop `path` from the page cache, so that the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_experts(layout: ModelLayout) -> None:
    """`evict` every expert file of a converted model."""
    for table in layout.expert_layers.values():
        evict(layout.path(table.file))
