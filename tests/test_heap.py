"""`heap.keep_freed_memory`: large arrays from malloc's heap, reused once freed (in a process of
their own: the setting is process-wide)."""

import json
import platform
import subprocess
import sys

import pytest

ARRAYS = """
import ctypes, json, sys
import numpy as np
from colibri.runtime.heap import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
facts = []
for _ in range(3):
    a = np.ones(64 << 20, np.uint8)  # above any mmap threshold glibc sets itself
    info = libc.mallinfo2()
    facts.append({"mapped": info.hblkhd, "heap": info.arena})
    del a
print(json.dumps({"kept": kept, "facts": facts}))
"""


def arrays(mode):
    out = subprocess.run([sys.executable, "-c", ARRAYS, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_freed_arrays_stay_in_the_heap_for_the_next():
    default, kept = arrays("default"), arrays("keep")
    assert all(f["mapped"] >= 64 << 20 for f in default["facts"])  # each array mapped apart, unmapped when freed
    assert kept["kept"] is True
    assert all(f["mapped"] < 64 << 20 for f in kept["facts"])
    heaps = [f["heap"] for f in kept["facts"]]
    assert heaps[0] >= 64 << 20 and heaps[0] == heaps[1] == heaps[2]  # the second and third took the first's pages
