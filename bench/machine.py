"""What the benchmarks measure the machine with: its read bandwidth, a cold page cache, and a
machine that is not idle.

Imported by the scripts beside it (a script's own folder is first on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
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


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes that each keep a core busy at this process's priority, for the block
    (issue 43's load: users' machines are rarely idle)."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()
