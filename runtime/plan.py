"""`colibri plan`: the memory budget and the speed to expect, before anything runs.

Budget = resident weights + KV cache + expert cache + scratch + the runtime itself, with
15% of RAM left to the OS and its page cache (an expert cache that starves the page cache
makes things slower, not faster). Decode speed is bounded by the disk when experts are
streamed, `disk_bw / (expert_bytes_per_token × (1 − hit_rate))`, and by memory bandwidth,
`mem_bw / bytes_touched_per_token`, whichever is lower.

Batches: B sequences decoding together read the union of their experts once per step. The
expected distinct experts per step come from uniform routing (E × (1 − (1 − k/E)^B) a layer)
or from a routing trace of an earlier run (unions of B of its tokens). With `costs` measured
on this machine (`measure_costs`: a step costs a + b × distinct experts + c × rows of
compute), the expected aggregate tok/s is B / (compute + the step's expert misses / disk_bw);
without them, only the ceilings are given. The same costs predict a sweep's time
(`runtime.sweep_plan`).

How to read experts (`--io`, `io_choice`): a container memory limit (cgroup) counts the page
cache against the process, so `direct` (or `mmap` with an expert cache well inside the limit)
is the safe choice there; otherwise the default, which bench/decode.py measured best.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np

from colibri.formats.layout import EXPERT_ALIGN, ModelLayout, align_up
from colibri.formats.safe_json import loads
from colibri.runtime.engine import scratch_bytes
from colibri.runtime.expert_store import DEFAULT_IO, IO_MODES, READ_THREADS, cache_bytes_for_all
from colibri.runtime.kernels import measure_read_bandwidth, without_amx
from colibri.runtime.memory import container_memory_limit, format_size, huge_page_buffer
from colibri.runtime.model import Decoder, Segment

OS_RESERVE = 0.15  # share of RAM left to the OS and the page cache
RUNTIME_BYTES = 400 << 20  # what the process holds before any weight: interpreter, numpy, numba, compiled kernels
KV_SHARE = 0.25  # the recommended --ctx keeps the KV cache within this share of free RAM
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# sequences per step of the measured decode steps: up to where a layer's experts each see
# several rows, as a sweep's steps do, since a step's cost per row falls until then
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CALIBRATION_PROMPT = 8  # tokens of their prompts
PROMPT_WINDOWS = (2, 2, 8)  # documents of the measured prompt passes (the first warms up)
PROMPT_MOST_TOKENS = 1024  # their prompts' length at most, whatever the job's
TRACE_MAX_BYTES = 1 << 30  # a routing trace read for the plan is at most this large
UNION_DRAWS = 64  # random groups of B traced tokens averaged per batch size


class TraceError(ValueError):
    """A routing trace that cannot be used; the message names the file."""


def distinct_uniform(n_experts: int, k: int, batch: int) -> float:
    """Expected distinct experts a layer when `batch` tokens each pick k of n_experts uniformly."""
    return n_experts * (1 - (1 - k / n_experts) ** batch)


def traced_choices(path, n_experts: int) -> dict[int, list[frozenset]]:
    """{layer: the expert set of each traced token} from a `colibri run --trace-routing` file."""
    size = os.path.getsize(path)
    if size > TRACE_MAX_BYTES:
        raise TraceError(f"{path}: {size} bytes; a routing trace for the plan is at most {TRACE_MAX_BYTES}")
    layers: dict[int, list[frozenset]] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            record = loads(line, f"{path} line {number}", TraceError)
            experts = record.get("experts") if isinstance(record, dict) else None
            layer = record.get("layer") if isinstance(record, dict) else None
            if not (type(layer) is int and isinstance(experts, list)
                    and all(type(e) is int and 0 <= e < n_experts for e in experts)):
                raise TraceError(f"{path} line {number}: not a routing record {{layer, experts}} of this model")
            layers.setdefault(layer, []).append(frozenset(experts))
    if not layers:
        raise TraceError(f"{path}: no routing records")
    return layers


def distinct_traced(layers: dict[int, list[frozenset]], batch: int, seed: int = 0) -> float:
    """Mean distinct experts per step (summed over layers) of `batch` traced tokens at a time
    (all of a layer's when the trace has no more)."""
    rng = np.random.default_rng(seed)
    total = 0.0
    for choices in layers.values():
        if batch >= len(choices):
            total += len(frozenset().union(*choices))
            continue
        draws = [rng.choice(len(choices), batch, replace=False) for _ in range(UNION_DRAWS)]
        total += float(np.mean([len(frozenset().union(*(choices[i] for i in d))) for d in draws]))
    return total


def measure_costs(path, threads: int | None = None, ram_budget=None, doc_tokens: int | None = None,
                  steps: int = 6) -> dict:
    """This machine's compute seconds for the model, from which the plan gives every speed:
    - a decode step: step_s + per_expert_s × distinct experts + per_row_s × rows, none
      negative, fitted for the least relative error to batch decode steps of
      CALIBRATION_BATCHES sequences at short contexts;
    - with `doc_tokens`: a sweep's prompt pass of prompts that long (at most
      PROMPT_MOST_TOKENS), prompt_pass_s + prompt_token_s × tokens, from sweeps of
      PROMPT_WINDOWS such prompts; and a decoded row's extra seconds per cached position
      (per_row_position_s), from its token mixers' time after those prompts and at the start.
    Each part opens the model with the context it needs, so that the many short decode
    sequences do not each hold a long prompt's KV cache. Expert read waits are left out: the
    plan takes the disk's time from its bytes."""
    from colibri.runtime import open_model

    def opened(ctx: int, parallel: int):
        return closing(open_model(path, threads=threads, ctx=max(64, ctx), ram_budget=ram_budget, parallel=parallel))

    with opened(CALIBRATION_PROMPT + steps + 2, max(CALIBRATION_BATCHES)) as model:
        costs = _decode_costs(model, steps)
    if doc_tokens:
        doc_tokens = min(doc_tokens, PROMPT_MOST_TOKENS)
        with opened(doc_tokens + 2, max(PROMPT_WINDOWS)) as model:
            costs.update(_prompt_pass_costs(model, doc_tokens))
    return costs


def nonnegative_fit(design: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Least squares coefficients of `design` for `values`, none negative: a term whose fit
    comes out negative is left out (0) and the others fitted again without it."""
    kept = list(range(design.shape[1]))
    while True:
        fit = np.linalg.lstsq(design[:, kept], values, rcond=None)[0]
        if (fit >= 0).all():
            break
        kept.pop(int(np.argmin(fit)))
    coefficients = np.zeros(design.shape[1])
    coefficients[kept] = fit
    return coefficients


def _timed_steps(model, runner):
    """(whether every sequence decoded, events, compute seconds, distinct experts) of each
    step until `runner` is done."""
    counters = model.store.counters
    while runner.busy:
        decoding = bool(runner.running) and all(s.decoding for s in runner.running) and not runner.queue
        waited, started = counters["waited_seconds"], time.perf_counter()
        events = runner.step()
        yield decoding, events, time.perf_counter() - started - (counters["waited_seconds"] - waited), \
            model.decoder.distinct_experts()


def _decode_costs(model, steps: int) -> dict:
    """step_s, per_expert_s and per_row_s fitted to batch decode steps (see `measure_costs`)."""
    rng = np.random.default_rng(0)
    samples = []
    for batch in (CALIBRATION_BATCHES[-1],) + CALIBRATION_BATCHES:  # the first pass warms up
        scheduler = model.scheduler()
        for _ in range(batch):
            scheduler.add([int(t) for t in rng.integers(3, model.config.vocab_size, CALIBRATION_PROMPT)], steps + 1,
                          ignore_eos=True)
        samples.append([(distinct, len(events), seconds) for decoding, events, seconds, distinct
                        in _timed_steps(model, scheduler) if decoding and events])
    rows = [m for measured in samples[1:] for m in measured]
    design = np.array([[1.0, d, b] for d, b, _ in rows])
    seconds = np.array([t for *_, t in rows])
    relative = 1 / seconds  # errors relative to each step's time: a step of one row weighs as one of 128
    a, b, c = nonnegative_fit(design * relative[:, None], seconds * relative)
    return {"step_s": float(a), "per_expert_s": float(b), "per_row_s": float(c),
            "position": CALIBRATION_PROMPT + (steps - 1) / 2, "samples": len(rows)}


def _prompt_pass_costs(model, doc_tokens: int) -> dict:
    """prompt_pass_s and prompt_token_s of a sweep's prompt pass over prompts of `doc_tokens`
    tokens, and per_row_position_s (see `measure_costs`)."""
    from colibri.runtime.sweep import Sweep

    rng = np.random.default_rng(1)
    passes = []
    for window in PROMPT_WINDOWS:
        sweep = Sweep(model, window)
        for _ in range(window):
            sweep.add([int(t) for t in rng.integers(3, model.config.vocab_size, doc_tokens)], 2, ignore_eos=True)
        passes.append((window * doc_tokens, next(_timed_steps(model, sweep))[2]))
    caches = [sweep.slots[sequence.slot] for sequence in sweep.running]  # the last window's, its prompts read
    (small, small_s), (large, large_s) = passes[-2:]  # the first pass warms up
    # the larger pass's time per token, and what the smaller took beyond that rate: a slope
    # through the two passes would carry their noise, a few times over, into every token
    token_s = large_s / large
    pass_s = max(small_s - token_s * small, 0.0)
    return {"doc_tokens": doc_tokens, "prompt_pass_s": pass_s, "prompt_token_s": token_s,
            "per_row_position_s": _row_position_s(model.decoder, caches, doc_tokens)}


def _row_position_s(decoder: Decoder, caches: list, position: int, repeats: int = 5) -> float:
    """A decoded row's extra seconds per position its cache holds: every layer's token mixer
    over one token of each cache at `position` against at position 0, best of `repeats` each.
    It writes those positions of the caches, which are the calibration's to spoil."""
    c = decoder.config
    shape = (len(caches), c.hyper_streams, c.hidden_size) if c.hyper_streams else (len(caches), c.hidden_size)
    x = np.random.default_rng(2).standard_normal(shape, dtype=np.float32)  # a mixer's time does not depend on it

    def best(at: int) -> float:
        segments = [Segment(row, 1, at, cache) for row, cache in enumerate(caches)]
        positions = np.full(len(caches), at)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for layer in range(c.n_layers):
                decoder.mix(layer, x, positions, segments)
            times.append(time.perf_counter() - started)
        return min(times)

    with without_amx():
        return max(best(position) - best(0), 0.0) / (len(caches) * position)


def step_seconds(costs: dict, distinct: float, rows: int, position: float | None = None) -> float:
    """Compute seconds of a decode step of `rows` sequences reading `distinct` experts, from
    `measure_costs`, each row with `position` tokens cached (default: the calibration's)."""
    beyond = 0.0 if position is None else max(position - costs["position"], 0.0)
    row_s = costs["per_row_s"] + costs.get("per_row_position_s", 0.0) * beyond
    return costs["step_s"] + costs["per_expert_s"] * distinct + row_s * rows


def measure_disk_bandwidth(layout: ModelLayout, max_bytes: int = 1 << 30, seconds: float = 3.0,
                           direct_io: bool = False) -> float:
    """Cold read speed of the expert files as the expert store reads them, bytes/s: one
    record per read, READ_THREADS reads in flight, in file order, the page cache dropped
    first (or bypassed with `direct_io`)."""
    records = [(table, expert) for table in layout.expert_layers.values() for expert in range(table.count)]
    if not records:
        raise ValueError("the model has no expert files to measure the disk with")
    length = max(align_up(table.expert_bytes, EXPERT_ALIGN) for table, _ in records)
    fds = {}
    for table, _ in records:
        if table.file not in fds:
            fds[table.file] = os.open(layout.path(table.file), os.O_RDONLY | (os.O_DIRECT if direct_io else 0))
            os.posix_fadvise(fds[table.file], 0, 0, os.POSIX_FADV_DONTNEED)
    buffers = [huge_page_buffer(length) for _ in range(READ_THREADS)]
    started = time.perf_counter()

    def read(worker: int) -> int:
        total = 0
        for table, expert in records[worker::READ_THREADS]:
            size = align_up(table.expert_bytes, EXPERT_ALIGN) if direct_io else table.expert_bytes
            total += os.preadv(fds[table.file], [buffers[worker][:size]], table.expert_offset(expert))
            if total * READ_THREADS >= max_bytes or time.perf_counter() - started > seconds:
                break
        return total

    try:
        with ThreadPoolExecutor(READ_THREADS) as pool:
            total = sum(pool.map(read, range(READ_THREADS)))
    finally:
        for fd in fds.values():
            os.close(fd)
    return total / max(time.perf_counter() - started, 1e-9)


def io_choice(container_limit: int | None) -> dict:
    """The `--io` mode to use on this machine and why, beside what each mode does."""
    if container_limit is not None:
        choice, why = "direct", (f"a container memory limit of {format_size(container_limit)} was found: the page cache "
                                 f"counts against it, and O_DIRECT keeps expert reads out of it (mmap with an "
                                 f"--expert-cache well inside the limit is the other safe choice)")
    else:
        choice, why = DEFAULT_IO, "no container memory limit found: the default, fastest or tied in every regime " \
                                  "bench/decode.py measured"
    return {"recommended": choice, "why": why, "modes": dict(IO_MODES), "container_memory_limit": container_limit}


def plan(layout: ModelLayout, ram: int, ctx: int | None = None, kv_quant: str = "f16", disk_bw: float | None = None,
         mem_bw: float | None = None, hit_rate: float | None = None, costs: dict | None = None,
         trace: dict | None = None) -> dict:
    """The budget table and the expected decode speed, as a dict (bytes, bytes/s, tok/s);
    `costs` from `measure_costs`, `trace` from `traced_choices`."""
    c = layout.config
    shape = Decoder.cache_shape_for(c)
    resident = Decoder.resident_bytes(layout)
    all_experts = sum(t.stride * t.count for t in layout.expert_layers.values())
    scratch = scratch_bytes(layout)
    reserve = int(ram * OS_RESERVE)
    free_for_model = ram - reserve - RUNTIME_BYTES - resident - scratch
    per_position = shape.nbytes(1, kv_quant) - shape.state_bytes()
    if ctx is None:
        limit = max(max(free_for_model, 0) * KV_SHARE - shape.state_bytes(), 0) // max(per_position, 1)
        ctx = 1 << max(int(limit).bit_length() - 1, 9)
        ctx = min(ctx, c.max_position_embeddings)
    kv = shape.nbytes(ctx, kv_quant)  # windowed layers keep their window, DeltaNet layers their states
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
    batches = batch_estimates(layout, kv, free_for_model, hit_rate, disk_bw, mem_bw, resident, costs, trace)
    return {
        "ram": ram,
        "fits": free_for_model - kv >= 0,
        "resident_bytes": resident,
        "kv_cache_bytes": kv,
        "state_bytes": shape.state_bytes(),  # of those, a DeltaNet's fixed-size states (any --ctx)
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
        "costs": costs,
        "routing": "trace" if trace else "uniform",
        "batches": batches,
        # one sequence's decode from the measured costs (disk-bound when --disk-bw is known), else None
        "expected_tok_per_s": (batches[0].get("expected_disk_tok_per_s") or batches[0]["expected_tok_per_s"])
        if costs else None,
        "io": io_choice(container_memory_limit()),
    }


def batch_estimates(layout: ModelLayout, kv_per_slot: int, free_for_model: int, hit_rate: float, disk_bw, mem_bw,
                    resident: int, costs: dict | None, trace: dict | None) -> list[dict]:
    """Per batch size: KV of its slots, whether they fit, distinct experts and expert bytes per
    step, and the expected aggregate decode tok/s (in RAM and disk-bound, from `costs`)
    or, without them, the memory and disk ceilings."""
    c = layout.config
    tables = list(layout.expert_layers.values())
    per_expert = sum(t.expert_bytes for t in tables) / max(len(tables), 1)
    rows = []
    for batch in BATCH_SIZES:
        if trace:
            distinct = distinct_traced(trace, batch)
        else:
            distinct = len(tables) * distinct_uniform(c.n_experts, c.n_experts_used, batch) if tables else 0.0
        step_bytes = distinct * per_expert
        row = {"batch": batch, "kv_bytes": batch * kv_per_slot, "fits": free_for_model - batch * kv_per_slot >= 0,
               "distinct_experts_per_step": distinct, "expert_bytes_per_step": step_bytes,
               "memory_ceiling_tok_per_s": batch * mem_bw / (resident + step_bytes)}
        streamed = step_bytes * (1 - hit_rate)
        row["disk_ceiling_tok_per_s"] = batch * disk_bw / streamed if disk_bw and streamed > 0 else None
        if costs:
            compute = step_seconds(costs, distinct, batch)
            row["expected_tok_per_s"] = batch / compute
            row["expected_disk_tok_per_s"] = batch / (compute + streamed / disk_bw) if disk_bw else None
        rows.append(row)
    return rows
