"""`colibri plan`: the memory budget and the speed to expect, before anything runs.

Budget = resident weights + KV cache + expert cache + scratch + the runtime itself, with
15% of RAM left to the OS and its page cache (an expert cache that starves the page cache
makes things slower, not faster). Decode speed is bounded by the disk when experts are
streamed, `disk_bw / (expert_bytes_per_token × (1 − hit_rate))`, and by memory bandwidth,
`mem_bw / bytes_touched_per_token`, whichever is lower.
"""

from __future__ import annotations

import os
import time


from colibri.formats.layout import ModelLayout
from colibri.runtime.engine import scratch_bytes
from colibri.runtime.expert_store import cache_bytes_for_all
from colibri.runtime.kernels import measure_read_bandwidth
from colibri.runtime.kv_cache import kv_bytes
from colibri.runtime.model import Decoder

OS_RESERVE = 0.15  # share of RAM left to the OS and the page cache
RUNTIME_BYTES = 400 << 20  # what the process holds before any weight: interpreter, numpy, numba, compiled kernels
KV_SHARE = 0.25  # the recommended --ctx keeps the KV cache within this share of free RAM


def measure_disk_bandwidth(layout: ModelLayout, max_bytes: int = 1 << 30, seconds: float = 3.0) -> float:
    """Cold sequential read speed of the expert files (page cache dropped first), bytes/s."""
    files = [layout.path(t.file) for t in layout.expert_layers.values()]
    if not files:
        raise ValueError("the model has no expert files to measure the disk with")
    buffer = bytearray(4 << 20)
    total, started = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while (n := os.readv(fd, [buffer])) > 0:
                total += n
                if total >= max_bytes or time.perf_counter() - started > seconds:
                    break
        finally:
            os.close(fd)
        if total >= max_bytes or time.perf_counter() - started > seconds:
            break
    return total / max(time.perf_counter() - started, 1e-9)


def plan(layout: ModelLayout, ram: int, ctx: int | None = None, kv_quant: str = "f16", disk_bw: float | None = None,
         mem_bw: float | None = None, hit_rate: float | None = None) -> dict:
    """The budget table and the expected decode speed, as a dict (bytes, bytes/s, tok/s)."""
    c = layout.config
    widths = Decoder.cache_widths_for(c)
    resident = Decoder.resident_bytes(layout)
    all_experts = sum(t.stride * t.count for t in layout.expert_layers.values())
    scratch = scratch_bytes(layout)
    reserve = int(ram * OS_RESERVE)
    free_for_model = ram - reserve - RUNTIME_BYTES - resident - scratch
    per_position = kv_bytes(c.n_layers, 1, widths, kv_quant)
    if ctx is None:
        limit = max(free_for_model, 0) * KV_SHARE // max(per_position, 1)
        ctx = 1 << max(int(limit).bit_length() - 1, 9)
        ctx = min(ctx, c.max_position_embeddings)
    kv = per_position * ctx
    cache_for_all = cache_bytes_for_all(layout)
    expert_cache = int(min(max(free_for_model - kv, 0), cache_for_all))
    expert_bytes_per_token = sum(t.expert_bytes * c.n_experts_used for t in layout.expert_layers.values())
    if hit_rate is None:  # uniform routing: the cache holds this share of the experts
        hit_rate = min(expert_cache / cache_for_all, 1.0) if cache_for_all else 1.0
    streamed = expert_bytes_per_token * (1 - hit_rate)
    mem_bw = mem_bw or measure_read_bandwidth()
    ceilings = {"memory": mem_bw / (resident + expert_bytes_per_token)}
    if disk_bw and streamed > 0:
        ceilings["disk"] = disk_bw / streamed
    return {
        "ram": ram,
        "fits": free_for_model - kv >= 0,
        "resident_bytes": resident,
        "kv_cache_bytes": kv,
        "ctx": ctx,
        "kv_quant": kv_quant,
        "expert_cache_bytes": expert_cache,
        "scratch_bytes": scratch,
        "runtime_bytes": RUNTIME_BYTES,
        "os_reserve_bytes": reserve,
        "all_experts_bytes": all_experts,
        "expert_bytes_per_token": expert_bytes_per_token,
        "hit_rate": hit_rate,
        "streamed_bytes_per_token": streamed,
        "disk_bandwidth": disk_bw,
        "memory_bandwidth": mem_bw,
        "ceiling_tok_per_s": min(ceilings.values()),
        "bound_by": min(ceilings, key=ceilings.get),
        "ceilings_tok_per_s": ceilings,
    }
