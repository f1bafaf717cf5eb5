"""Sweeps: a window of documents through the model layer by layer, for folder jobs.

A `Sweep` keeps up to `window` sequences in KV slots: the model's own, or a pool mapped in a
--scratch folder. At the start, and whenever half its slots are free, it admits queued
documents and reads all their prompts layer-major (`read_prompts`): layer 0 over every prompt
token of every admitted document, then layer 1, and so on, so that each layer's routed experts
are read once for all of them. Between admissions every step decodes all running sequences
together (`batch.Scheduler.step`), reading the union of their experts once a layer.

Batch invariance holds as in `runtime.batch`: a prompt is cut at the same STEP_PROMPT_TOKENS
positions, each cut reaches a layer's token mixer with the cache as the scheduler would have
filled it, and the FFNs take each row on its own; so a document's tokens and logits are those
it gets alone. A layer's token mixer takes the prompts in runs whose MLA expansions, kept from
one cut to the next (`runtime.kept_expansions`), fit their budget together.
"""

from __future__ import annotations

import mmap
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from colibri.formats.layout import ModelLayout
from colibri.formats.model_config import ModelConfig
from colibri.runtime import kept_expansions, kernels
from colibri.runtime.batch import STEP_PROMPT_TOKENS, STEP_TOKENS, Event, Scheduler
from colibri.runtime.engine import BudgetError, fitting_parallel, plan_budget
from colibri.runtime.heap import keep_freed_memory
from colibri.runtime.kv_cache import FLOAT_KINDS, KVCache, KVPool
from colibri.runtime.memory import format_size
from colibri.runtime.model import Decoder, Segment
from colibri.runtime.options import EngineOptions

SWEEP_MOST = 4096  # documents a window holds at most
FFN_BLOCK_BYTES = 1 << 30  # hidden states of one FFN call of a prompt pass (its experts are read once per call)
FFN_VALUE_BYTES = 13  # bytes a hidden value takes in an FFN call: the input, its norm, int8 copy, output (the sum goes into the input)


def sweep_window(layout: ModelLayout, options: EngineOptions, documents: int, scratch: Path | None,
                 baseline: int | None = None) -> int:
    """The documents a sweep holds at once: `options.parallel`, else as many as `documents` and
    SWEEP_MOST allow whose KV caches and prompt hidden states (--ctx positions each) fit in a
    quarter of the RAM the budget leaves after the resident weights and a prompt pass's FFN
    call, or with `scratch`, in half the folder's free space. `baseline`: as `fitting_parallel`."""
    most = max(1, min(documents, SWEEP_MOST))
    if options.parallel is not None:
        return options.parallel
    hidden = hidden_bytes(layout.config, options.ctx)
    if scratch is None:
        return fitting_parallel(layout, options.ctx, options.kv_quant, options.ram_budget, most, hidden,
                                reserved=ffn_block_bytes(layout.config, most * options.ctx), baseline=baseline)
    per_document = Decoder.cache_shape_for(layout.config).nbytes(options.ctx, options.kv_quant) + hidden
    return max(1, min(most, shutil.disk_usage(scratch).free // 2 // per_document))


def sweep_options(layout: ModelLayout, options: EngineOptions, window: int, scratch: Path | None,
                  baseline: int | None = None) -> EngineOptions:
    """The options to open the model with for a sweep of `window` documents: with `scratch`, one
    KV slot of its own (the window's are mapped there), else the window's slots; and unless
    --expert-cache is given, an expert cache that leaves the budget room for a prompt pass's
    FFN call and, without `scratch`, its hidden states. Raises BudgetError when there is none.
    `baseline`: as `engine.plan_budget`."""
    options = options.replace(parallel=1 if scratch else window)
    if options.expert_cache is not None:
        return options
    budget = plan_budget(layout, options.ctx, options.kv_quant, options.ram_budget, None, options.parallel, baseline)
    held = ffn_block_bytes(layout.config, window * options.ctx) + \
        (0 if scratch else window * hidden_bytes(layout.config, options.ctx))
    room = budget.ram - budget.fixed - held
    if room < 0:
        raise BudgetError(f"--ram-budget {format_size(budget.ram)} cannot hold a sweep of {window} documents: their "
                          f"prompt passes need {format_size(held)} beside {format_size(budget.fixed)} of weights, KV "
                          f"cache and runtime; lower --parallel or --ctx, or give --scratch")
    return options.replace(expert_cache=min(budget.expert_cache, room))


def hidden_bytes(c: ModelConfig, tokens: int) -> int:
    """The hidden states of `tokens` prompt tokens in a prompt pass (float32, every stream)."""
    return 4 * tokens * _token_values(c)


def ffn_block_bytes(c: ModelConfig, tokens: int) -> int:
    """The activations of one FFN call of a prompt pass over `tokens` tokens (its block)."""
    return min(FFN_BLOCK_BYTES, FFN_VALUE_BYTES * tokens * _token_values(c))


def ffn_block_tokens(c: ModelConfig) -> int:
    """The tokens of one FFN call of a prompt pass: its experts are read once per call."""
    return max(1, FFN_BLOCK_BYTES // (FFN_VALUE_BYTES * _token_values(c)))


def _token_values(c: ModelConfig) -> int:
    """The values of one token's hidden state: a stream of `hidden_size`, or `hyper_streams` of them."""
    return (c.hyper_streams or 1) * c.hidden_size


def scratch_array(shape: tuple, dtype, directory: Path) -> np.ndarray:
    """A zeroed array mapped from a nameless file in `directory`: the kernel writes its pages
    there when RAM is short, and the file is gone with the array or the process."""
    size = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    with tempfile.TemporaryFile(dir=directory) as file:
        file.truncate(size)
        mapped = mmap.mmap(file.fileno(), size)
    return np.frombuffer(mapped, dtype, int(np.prod(shape))).reshape(shape)


def read_prompts(decoder: Decoder, batch: list[tuple[list[int], KVCache]], allocate=np.zeros,
                 on_layer=None) -> np.ndarray:
    """Logits [len(batch), vocab] of the last token of each (prompt, cache) pair, every prompt
    placed after its cache's contents: each layer runs over all the prompts before the next
    does, and then calls `on_layer(layer)` when given. The hidden states [tokens, hidden] come
    from `allocate(shape, dtype)`."""
    c = decoder.config
    for ids, cache in batch:
        cache.check_room(cache.length, len(ids))
    lengths = np.array([len(ids) for ids, _ in batch], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate([np.asarray(ids, np.int64) for ids, _ in batch])
    positions = np.concatenate([np.arange(cache.length, cache.length + len(ids)) for ids, cache in batch])
    x = allocate((tokens.size, c.hyper_streams, c.hidden_size) if c.hyper_streams else (tokens.size, c.hidden_size),
                 np.float32)
    block = ffn_block_tokens(c)
    # every layer's FFN output in turn, in RAM (an FFN block's memory, `ffn_block_bytes`)
    ffn_out = np.empty((min(block, tokens.size), c.hidden_size), np.float32)
    for first in range(0, tokens.size, block):
        rows = np.concatenate([decoder.embed.rows_f32(int(t), 1) for t in tokens[first:first + block]])
        x[first:first + block] = decoder.hyper_streams(rows) if c.hyper_streams else rows
    groups = _groups(lengths, kept_expansions.position_bytes(c), decoder.expansion_budget.limit)
    runs = [([batch[i][1] for i in g], _passes(lengths[g], offsets[g], [batch[i] for i in g])) for g in groups]
    with kernels.without_amx():
        for layer in range(c.n_layers):
            for caches, passes in runs:
                for rows, segments in passes:
                    x[rows] = decoder.mix(layer, x[rows], positions[rows], segments)
                for cache in caches:  # (a prompt whose last cut was a long one kept its expansion for none)
                    cache.forget_expansion(layer)
            for first in range(0, tokens.size, block):
                part = slice(first, first + block)
                x[part] = decoder.feed(layer, x[part], tokens[part], positions[part], batch_invariant=True,
                                       out=ffn_out[:len(tokens[part])])
            if on_layer is not None:
                on_layer(layer)
        last = x[offsets[1:] - 1]
        logits = decoder.logits(decoder.hyper_collapse(last) if c.hyper_streams else last)
    for ids, cache in batch:
        cache.length += len(ids)
    return logits


def _groups(lengths: np.ndarray, position_bytes: int, budget: int) -> list[np.ndarray]:
    """The prompts in runs whose MLA expansions, kept from cut to cut, fit `budget` together; a
    layer reads one run's cuts after another's, so each run keeps its own."""
    groups, first, held = [], 0, 0
    for i, length in enumerate(lengths):
        need = int(length) * position_bytes
        if i > first and held + need > budget:
            groups.append(np.arange(first, i))
            first, held = i, 0
        held += need
    return groups + [np.arange(first, len(lengths))]


def _passes(lengths: np.ndarray, offsets: np.ndarray, batch) -> list[tuple[np.ndarray, list[Segment]]]:
    """The token mixers' passes of `read_prompts`: pass j holds cut j (STEP_PROMPT_TOKENS
    tokens) of every prompt that long, as (its rows of the hidden states, their segments)."""
    passes = []
    for start in range(0, int(lengths.max()), STEP_PROMPT_TOKENS):
        rows, segments, first = [], [], 0
        for length, offset, (_, cache) in zip(lengths, offsets, batch):
            count = min(int(length) - start, STEP_PROMPT_TOKENS)
            if count > 0:
                segments.append(Segment(first, count, cache.length + start, cache))
                rows.append(np.arange(offset + start, offset + start + count))
                first += count
        passes.append((np.concatenate(rows), segments))
    return passes


class Sweep(Scheduler):
    """A `batch.Scheduler` whose admitted documents read their prompts layer-major (`read_prompts`).

    `window` documents at once (default: the model's KV slots); with `scratch`, their KV caches
    and the prompt passes' hidden states are mapped from nameless files in that folder.
    `on_layer(layer, documents)` is called as a prompt pass of `documents` finishes a layer.
    Its process's malloc keeps freed memory from then on (`heap.keep_freed_memory`): a pass's
    arrays of hundreds of MB reuse the last ones' pages.
    """

    def __init__(self, model, window: int | None = None, scratch: Path | None = None, on_layer=None,
                 keep_logits: bool = False):
        keep_freed_memory()
        self.on_layer = on_layer
        self.allocate = np.zeros if scratch is None else partial(scratch_array, directory=scratch)
        if scratch is None and window in (None, len(model.slots)):
            slots = model.slots
        else:
            shape, count, kind = Decoder.cache_shape_for(model.config), window or len(model.slots), model.cache.kind
            slots = KVPool(shape, model.ctx, kind, count, self.allocate).caches if kind in FLOAT_KINDS else \
                [KVCache(shape, model.ctx, kind, allocate=self.allocate) for _ in range(count)]
        super().__init__(model, keep_logits, slots, step_tokens=max(STEP_TOKENS, len(slots)))

    def step(self) -> list[Event]:
        """Admit queued documents and read their prompts, when none runs or half the slots are
        free; else decode one token of every running sequence."""
        if not self.queue or (self.running and 2 * len(self.free) < len(self.slots)):
            return super().step(admit=False)
        started = time.perf_counter()
        admitted = self.admit()
        batch = [(sequence.prompt, self.slots[sequence.slot]) for sequence in admitted]
        progress = None if self.on_layer is None else lambda layer: self.on_layer(layer, len(batch))
        logits = self.model.tuned(False, lambda: read_prompts(self.model.decoder, batch, self.allocate, progress))
        events = []
        for sequence, row in zip(admitted, logits):
            sequence.read = len(sequence.prompt)
            self.counters["prompt_tokens"] += sequence.read
            events.append(self._sample(sequence, row))
        self._count_step(sum(len(ids) for ids, _ in batch), started)
        return events
