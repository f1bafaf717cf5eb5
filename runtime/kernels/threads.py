"""The kernels' threads: how many numba runs, the rows each one takes, the bandwidth they read at.

Each parallel kernel gives thread `t` one contiguous range of rows (`part_range`): one memory
stream per thread.
"""

from __future__ import annotations

import threading
import warnings

import numba
import numpy as np
from numba import njit, prange

_njit = njit(cache=True, nogil=True)
_parallel = njit(cache=True, nogil=True, parallel=True)

_warned_workqueue = False
_chosen = threading.local()  # the count set_threads gave this thread (numba's own is per thread too)


def set_threads(n: int) -> None:
    """Use `n` threads in the kernels (numba.set_num_threads); warns once when numba runs on
    its `workqueue` threading layer, whose fixed cost per parallel call slows decoding down."""
    global _warned_workqueue
    numba.set_num_threads(n)
    _chosen.count = n
    if numba.threading_layer() == "workqueue" and not _warned_workqueue:
        _warned_workqueue = True
        warnings.warn("numba is using its 'workqueue' threading layer: every kernel call pays for starting its threads. "
                      "Install an OpenMP runtime or tbb (pip install tbb) and set NUMBA_THREADING_LAYER=omp "
                      "or tbb.", RuntimeWarning, stacklevel=2)


def most_threads() -> int:
    """The threads numba started with: the cores it may use."""
    return numba.config.NUMBA_NUM_THREADS


def thread_count() -> int:
    """The threads this thread's kernel calls use: what `set_threads` last set here, without
    numba.get_num_threads()'s lock on every call of a decoded token's many."""
    count = getattr(_chosen, "count", None)
    return numba.get_num_threads() if count is None else count


@_njit
def part_range(count, parts, part, align):
    """Rows [first, stop) of `part` when `count` rows are cut into `parts` contiguous ranges
    whose bounds are multiples of `align`."""
    units = (count + align - 1) // align
    return min(count, units * part // parts * align), min(count, units * (part + 1) // parts * align)


@_parallel
def _read_stream(words, nthreads):
    """XOR of every word, each thread over one contiguous range: a pure read stream."""
    partial = np.zeros(nthreads, np.uint64)
    for t in prange(nthreads):
        part = words[words.size * t // nthreads:words.size * (t + 1) // nthreads]
        acc = np.uint64(0)
        for i in range(part.size):  # indices from 0: no negative-index checks, vectorized
            acc ^= part[i]
        partial[t] = acc
    return partial


def read_seconds(words: np.ndarray, threads: int) -> float:
    """Seconds one pass of `threads` read streams takes over `words` (uint64)."""
    import time

    started = time.perf_counter()
    _read_stream(words, threads)
    return time.perf_counter() - started


def measure_read_bandwidth(nbytes: int = 256 << 20, threads: int | None = None, repeat: int = 3) -> float:
    """Bytes/s that `threads` (default: numba's count) contiguous read streams reach: the
    memory bandwidth a weight-streaming kernel can hope for (median of `repeat`)."""
    threads = threads or thread_count()
    words = np.ones(nbytes // 8, np.uint64)
    read_seconds(words, threads)  # compile, and touch the pages
    return nbytes / sorted(read_seconds(words, threads) for _ in range(repeat))[repeat // 2]
