"""Expert files mapped read-only (`--io mmap`): the kernels read each record in place.

A mapped expert costs no copy and no cache slot of our own: its pages are the page cache's,
shared by every process that maps the model and still there after a crash or a restart. The
store's cache index decides which records count as cached inside the expert-cache budget;
here, `populate` makes a record resident before the kernels read it (MADV_WILLNEED, one
readahead of the whole record, then MADV_POPULATE_READ, which waits for it and maps the pages;
on the store's reader threads), and `release` gives an evicted one back: MADV_COLD marks its
pages first to reclaim, MADV_DONTNEED unmaps them. A page fault maps the pages around it that
the page cache holds (Linux's fault-around, 64 KB): `populate` unmaps what that spilled into
neighbouring records the store does not keep. The process's share, `resident_bytes` (its
mapped pages, from /proc/self/smaps), stays inside the budget; the page cache keeps what it has
room for, as it does for buffered reads (`cached_bytes`, from mincore).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np

PAGE = mmap.PAGESIZE
MADV_COLD, MADV_POPULATE_READ = 20, 22  # Linux 5.4 and 5.14; Python's mmap module does not name them
FAULT_AROUND = 64 << 10  # bytes a page fault maps around it, aligned (Linux's default fault_around_bytes)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class MappedExperts:
    """One MoE layer's expert file mapped read-only: `records` uint8 [count, stride], a row per
    expert, in place in the mapping."""

    def __init__(self, path, table):
        size, needed = os.path.getsize(path), table.offset + table.count * table.stride
        if size < needed or table.offset % PAGE:
            raise OSError(f"{path}: {size} bytes with records from byte {table.offset}; mapping needs whole "
                          f"page-aligned records, {needed} bytes (offset + count x stride); use --io pread")
        self.path, self.table = path, table
        self.fd = os.open(path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, needed, prot=mmap.PROT_READ)
        self.map.madvise(mmap.MADV_RANDOM)  # no readahead past a record: the next one is another expert
        self.records = np.frombuffer(self.map, np.uint8, table.count * table.stride, table.offset).reshape(
            table.count, table.stride)

    def _range(self, expert: int) -> tuple[int, int]:
        """(start, length) of expert's record in the mapping, in whole pages (as madvise takes them)."""
        return self.table.offset + expert * self.table.stride, -(-self.table.expert_bytes // PAGE) * PAGE

    def populate(self, expert: int, kept) -> None:
        """Read expert's record into RAM and map its pages, before the kernels touch them;
        `kept(e)` says whether the store keeps expert e (its pages may stay mapped)."""
        start, length = self._range(expert)
        self.map.madvise(mmap.MADV_WILLNEED, start, length)  # one readahead, not a read per page fault
        try:
            self.map.madvise(MADV_POPULATE_READ, start, length)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14; fault the pages in by reading them
                raise OSError(f"{self.path}: reading expert {expert} failed ({e.strerror})") from None
            int(self.records[expert, :length:PAGE].sum())
        t = self.table
        for lo, hi in ((start - FAULT_AROUND, start), (start + length, start + length + FAULT_AROUND)):
            for neighbour in range(max((lo - t.offset) // t.stride, 0), min(-(-(hi - t.offset) // t.stride), t.count)):
                first = t.offset + neighbour * t.stride
                lo_in, hi_in = max(lo, first), min(hi, first + t.stride)  # its padding too
                if hi_in > lo_in and not (neighbour != expert and kept(neighbour)):
                    self.map.madvise(mmap.MADV_DONTNEED, lo_in, hi_in - lo_in)

    def release(self, expert: int) -> None:
        """Unmap expert's pages, marked first to reclaim (hints: the data stays valid)."""
        start, length = self.table.offset + expert * self.table.stride, self.table.stride
        try:
            self.map.madvise(MADV_COLD, start, length)
        except OSError as e:
            if e.errno != errno.EINVAL:  # a kernel before 5.4: unmapping is enough
                raise
        self.map.madvise(mmap.MADV_DONTNEED, start, length)

    def resident_bytes(self) -> int:
        """Bytes of the records mapped into this process (its RSS share of the mapping)."""
        first, last = self.records.ctypes.data, self.records.ctypes.data + self.records.nbytes
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                if "-" in line.split(" ", 1)[0] and not line[0].isupper():  # a mapping's header line
                    start, end = (int(a, 16) for a in line.split(" ", 1)[0].split("-"))
                    inside = start < last and end > first
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
        return total

    def cached_bytes(self) -> int:
        """Bytes of the records in the page cache (mapped by this process or not, or no longer)."""
        pages = np.zeros(-(-self.records.nbytes // PAGE), np.uint8)
        if _libc.mincore(self.records.ctypes.data, self.records.nbytes, pages.ctypes.data):
            raise OSError(ctypes.get_errno(), f"{self.path}: mincore failed")
        return int(np.count_nonzero(pages & 1)) * PAGE

    def close(self) -> None:
        self.records = None
        try:
            self.map.close()
        except BufferError:  # a view of the records is still alive: the mapping goes with it
            pass
        os.close(self.fd)
