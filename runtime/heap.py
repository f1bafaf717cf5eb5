"""Large temporaries reused from the C heap: `keep_freed_memory`.

glibc gives every allocation above its mmap threshold (32 MB at most) pages of its own, and
gives them back to the kernel when the array is freed: the next array of that size faults each
of its pages in again, and unmapping the last one interrupts every thread that touched it. A
sweep's prompt pass allocates arrays of hundreds of MB per layer and pass. With malloc's mmap
off and the heap's top never trimmed, a freed array stays in the heap and the next one takes
its pages as they are. The peak RSS stays what it was; the RSS no longer falls back after it.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes (an int)


def keep_freed_memory() -> bool:
    """Make this process's malloc keep what is freed for the next allocations (glibc; process-
    wide, for the rest of its life). Whether it took effect (False with another C library)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
