"""A sweep's cost before it runs (`colibri plan --docs`): its window, time, bytes read and scratch.

Predicted from the disk's read rate and, when measured (`plan.measure_costs`), this machine's
compute costs. A window of n documents of T prompt tokens, each generating G, costs:
- its prompt pass: prompt_pass_s + prompt_token_s × n × T;
- G − 1 decode steps of n rows: step_s + per_expert_s × distinct experts + n × (per_row_s +
  per_row_position_s × the positions cached beyond the calibration's);
- and each pass reads the experts it touches that the expert cache does not hold.
Distinct experts follow uniform routing, or a routing trace of an earlier run. The cache
evicts the least recently used expert and every pass goes through the layers in order, so a
pass finds experts in the cache only when it holds a whole pass's (`lru_hit_rate`). A prompt
pass computes a layer's many tokens while the layer's experts arrive, so it takes the longer
of its compute and its reads; a decode step is short against its reads, which add to it.
"""

from __future__ import annotations

from pathlib import Path

from colibri.formats.layout import ModelLayout
from colibri.runtime.engine import BudgetError
from colibri.runtime.expert_store import cache_bytes_for_all
from colibri.runtime.model import Decoder
from colibri.runtime.options import EngineOptions
from colibri.runtime.plan import RUNTIME_BYTES, distinct_traced, distinct_uniform, step_seconds
from colibri.runtime.sweep import ffn_block_tokens, hidden_bytes, sweep_options, sweep_window


def lru_hit_rate(cache_share: float, touched: float) -> float:
    """The share of a pass's experts that an LRU cache holding `cache_share` of all experts
    serves, when every pass touches a random `touched` share of them in layer order: none
    unless the cache holds a whole pass, else those that one of the passes it holds touched."""
    if touched <= 0 or cache_share >= 1:
        return 1.0
    if cache_share < touched:
        return 0.0
    return 1 - (1 - touched) ** (cache_share / touched)


def _expert_bytes(layout: ModelLayout) -> int:
    """The bytes a read of every routed expert of the model takes."""
    return sum(t.expert_bytes * t.count for t in layout.expert_layers.values())


def _touched(layout: ModelLayout, tokens: int, trace: dict | None) -> float:
    """The share of a layer's experts that `tokens` tokens touch: routed uniformly, or as in
    `trace` (`plan.traced_choices`)."""
    c = layout.config
    if trace:
        return distinct_traced(trace, tokens) / (c.n_experts * len(trace))
    return distinct_uniform(c.n_experts, c.n_experts_used, tokens) / c.n_experts


def window_reads(layout: ModelLayout, documents: int, doc_tokens: int, gen_tokens: int, cache_share: float,
                 trace: dict | None = None) -> tuple[float, float]:
    """Bytes one window of `documents` reads from disk once the cache is warm: in its prompt
    pass, and in its decode steps. The prompt pass's FFN runs in blocks of tokens
    (`sweep.ffn_block_tokens`); each block reads the layer's experts again unless the cache
    holds one block's experts of a layer."""
    all_bytes = _expert_bytes(layout)
    tokens = documents * doc_tokens
    block = ffn_block_tokens(layout.config)
    prompt, step = _touched(layout, tokens, trace), _touched(layout, documents, trace)
    blocks = 1 if cache_share * len(layout.expert_layers) >= _touched(layout, min(tokens, block), trace) \
        else -(-tokens // block)
    return (all_bytes * blocks * prompt * (1 - lru_hit_rate(cache_share, prompt)),
            all_bytes * max(gen_tokens - 1, 0) * step * (1 - lru_hit_rate(cache_share, step)))


def window_compute(layout: ModelLayout, costs: dict, documents: int, doc_tokens: int, gen_tokens: int,
                   trace: dict | None = None) -> tuple[float, float]:
    """Compute seconds of one window of `documents`: its prompt pass, and its decode steps."""
    distinct = _touched(layout, documents, trace) * layout.config.n_experts * len(layout.expert_layers)
    step_s = step_seconds(costs, distinct, documents, doc_tokens + (gen_tokens - 2) / 2)
    return costs["prompt_pass_s"] + costs["prompt_token_s"] * documents * doc_tokens, max(gen_tokens - 1, 0) * step_s


def sweep_estimate(layout: ModelLayout, costs: dict | None, docs: int, doc_tokens: int, gen_tokens: int, window: int,
                   expert_cache: int, disk_bw: float, trace: dict | None = None) -> dict:
    """Bytes read (all, and per generated token) and the disk's time for a sweep of `docs`
    documents, `window` at a time, through an expert cache of `expert_cache` bytes; with
    `costs`, also its compute time, total time (prompt passes overlapping their reads, decode
    steps adding theirs), tok/s and what bounds it (else None); with `trace`, the experts
    touched as in that routing trace."""
    cache_share = min(expert_cache / max(cache_bytes_for_all(layout), 1), 1.0)
    full, last = divmod(docs, window)
    first = _touched(layout, min(window, docs) * doc_tokens, trace)
    cold = _expert_bytes(layout) * first * lru_hit_rate(cache_share, first)  # the first pass finds the cache empty
    # (documents, how many such windows, bytes each one's prompt pass reads beyond a warm one's)
    windows = [(window, 1, cold), (window, full - 1, 0.0)] if full else []
    windows += [(last, 1, 0.0 if full else cold)] if last else []
    reads = [window_reads(layout, n, doc_tokens, gen_tokens, cache_share, trace) for n, _, _ in windows]
    read = sum(count * (prompt + extra + decode) for (_, count, extra), (prompt, decode) in zip(windows, reads))
    disk_s = read / disk_bw
    generated = docs * gen_tokens
    estimate = {"window": window, "windows": full + (1 if last else 0), "expert_cache_bytes": expert_cache,
                "bytes_read": read, "bytes_per_generated_token": read / generated, "disk_s": disk_s,
                "compute_s": None, "seconds": None, "tok_per_s": None, "bound_by": None}
    if costs is not None:
        compute = seconds = 0.0
        for (n, count, extra), (prompt_read, decode_read) in zip(windows, reads):
            prompt_s, decode_s = window_compute(layout, costs, n, doc_tokens, gen_tokens, trace)
            compute += count * (prompt_s + decode_s)
            seconds += count * (max(prompt_s, (prompt_read + extra) / disk_bw) + decode_s + decode_read / disk_bw)
        estimate.update(compute_s=compute, seconds=seconds, tok_per_s=generated / seconds,
                        bound_by="disk" if disk_s > compute else "compute")
    return estimate


def sweep_plan(layout: ModelLayout, costs: dict | None, disk_bw: float, docs: int, doc_tokens: int, gen_tokens: int,
               ram_budget: int, kv_quant: str, ctx: int | None = None, parallel: int | None = None,
               scratch: Path | None = None, trace: dict | None = None) -> dict:
    """The sweep `colibri run --sweep` would run for this job within `ram_budget` (its window,
    as `sweep_window` chooses it, or `parallel`; its expert cache, as `sweep_options` sizes it),
    with `sweep_estimate`'s figures and where its KV caches and hidden states go: RAM, or
    `scratch`; distinct experts from `trace` when given. Says `fits: False` and why when the
    budget cannot hold the window."""
    ctx = ctx or doc_tokens + gen_tokens
    options = EngineOptions(ctx=ctx, ram_budget=ram_budget, kv_quant=kv_quant, parallel=parallel)
    window = sweep_window(layout, options, docs, scratch, baseline=RUNTIME_BYTES)  # the run's runtime, not this process
    per_document = Decoder.cache_shape_for(layout.config).nbytes(ctx, kv_quant) + hidden_bytes(layout.config, doc_tokens)
    held = {"docs": docs, "doc_tokens": doc_tokens, "gen_tokens": gen_tokens, "ctx": ctx, "ram_budget": ram_budget,
            "window_bytes": window * per_document, "scratch_bytes": window * per_document if scratch else 0,
            "scratch": str(scratch) if scratch else None}
    try:
        opened = sweep_options(layout, options, window, scratch, baseline=RUNTIME_BYTES)
    except BudgetError as e:
        return {**held, "window": window, "fits": False, "why": str(e)}
    return {**held, "fits": True, "routing": "trace" if trace else "uniform",
            **sweep_estimate(layout, costs, docs, doc_tokens, gen_tokens, window, opened.expert_cache, disk_bw, trace)}
