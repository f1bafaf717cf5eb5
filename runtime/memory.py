"""Sizes in the units users type (`4G`, `512M`) and what the process really holds."""

from __future__ import annotations

import argparse
import mmap
import os
import re
import resource

import numpy as np

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text) -> int:
    """'4G', '512M', '1.5G', '0' or a plain byte count → bytes (binary units)."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r} is not a number with an optional K/M/G/T suffix (e.g. 4G, 512M)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def size_argument(text: str) -> int:
    """parse_size for argparse: a bad size is a usage error, not a traceback."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_size(nbytes: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(nbytes) < 1024 or unit == "T":
            return f"{nbytes:.0f}{unit}" if unit == "B" else f"{nbytes:.2f}{unit}"
        nbytes /= 1024
    return f"{nbytes}"


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 [nbytes] on fresh private pages, page-aligned (O_DIRECT reads into
    it), for which the kernel is asked to use 2 MB pages: weights streamed through 4 KB pages
    cost a TLB miss per page (bench/RESULTS.md has the gain)."""
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, np.uint8, nbytes)


def container_memory_limit(root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`)
    when one is set below the machine's RAM, else None. Page cache counts against it."""
    candidates = []
    try:
        with open(cgroup_file) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":  # v2
                    candidates += [os.path.join(root, path.lstrip("/"), "memory.max"), os.path.join(root, "memory.max")]
                elif "memory" in controllers.split(","):
                    base = os.path.join(root, "memory")
                    candidates += [os.path.join(base, path.lstrip("/"), "memory.limit_in_bytes"),
                                   os.path.join(base, "memory.limit_in_bytes")]
    except (OSError, ValueError):
        return None
    limits = []
    for candidate in candidates:
        try:
            with open(candidate) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < total_ram():
            limits.append(int(value))
    return min(limits, default=None)
