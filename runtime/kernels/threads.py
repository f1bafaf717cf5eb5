"""The kernels' threads: how many numba runs, the rows each one takes, the bandwidth they read at.

Most parallel kernels give thread `t` one contiguous range of rows (`part_range`): one memory
stream per thread. A decoded token's routed experts, where one thread's half can take longer
than the other's (an interrupt, a busier core), are cut into many small parts that the threads
take in turn from a shared counter (`take_part`), as ggml's threads take their chunks; either
way each row is computed once, by one thread, in the same order of arithmetic.
"""

from __future__ import annotations

import threading
import warnings

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

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


@intrinsic
def take_part(typingctx, counter):
    """The next part for the calling thread: counter[0] (an int64 array shared by the threads),
    then incremented, atomically. Numba's own analysis does not see the write: read the counter
    only through this."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter), codegen


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
