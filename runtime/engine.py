"""`open_model`: a converted model opened for generation inside a RAM budget.

    m = open_model(path, threads=2, ctx=4096, ram_budget="8G", expert_cache="2G", kv_quant="f16")  # EngineOptions' fields
    logits = m.prefill(token_ids)      # float32 [len(token_ids), vocab]; fills the KV cache
    last = m.prefill(token_ids, all_logits=False)  # float32 [1, vocab]: only the last position's
    step = m.decode(token_id)          # float32 [vocab] for the next position
    m.reset()                          # empty the KV cache
    for piece in m.generate("Hello", max_tokens=32): print(piece, end="")
    m.stats()                          # speeds, cache hit rate, bytes read per token, peak RSS
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from colibri.formats.layout import ModelLayout
from colibri.runtime import kernels
from colibri.runtime.expert_store import ExpertStore, cache_bytes_for_all
from colibri.runtime.kept_expansions import EXPANDED_MLA_KEEP_BYTES
from colibri.runtime.kv_cache import FLOAT_KINDS, WRITE_ROOM, ContextOverflow, KVCache, KVPool
from colibri.runtime.memory import current_rss, format_size, parse_size, peak_rss, total_ram
from colibri.runtime.model import Decoder
from colibri.runtime.options import AUTO_THREADS, MOST_PARALLEL, EngineOptions
from colibri.runtime.thread_tuner import ThreadTuner

SCRATCH_BYTES = 64 << 20  # activations and attention scores of one step, generously
PREFILL_CHUNK = WRITE_ROOM  # prompt tokens per forward pass (llama.cpp's ubatch): bounds a prompt's activations
NORMALIZER_SLACK = 4  # how much a tokenizer's normalizer may be assumed to shorten a text


def scratch_bytes(layout: ModelLayout) -> int:
    """Activations of one step, plus scratch slots for one token's experts when the cache is too
    small, plus MLA's expansions kept between prompt cuts."""
    record = max((t.expert_bytes for t in layout.expert_layers.values()), default=0)
    kept = EXPANDED_MLA_KEEP_BYTES if layout.config.attention == "mla" else 0
    return SCRATCH_BYTES + record * layout.config.n_experts_used + kept


class BudgetError(Exception):
    """A RAM budget that cannot hold what the model needs; the message gives the numbers."""


class PromptError(ValueError):
    """A prompt the model cannot take: empty, or token ids outside the vocabulary."""


@dataclass
class Budget:
    ram: int
    baseline: int  # the process before the model: interpreter, numpy, numba
    resident: int
    kv: int
    scratch: int
    expert_cache: int

    @property
    def fixed(self) -> int:
        return self.baseline + self.resident + self.kv + self.scratch


def default_ram_budget() -> int:
    return int(total_ram() * 0.8)


def plan_budget(layout: ModelLayout, ctx: int, kv_quant: str, ram_budget, expert_cache, parallel: int = 1,
                baseline: int | None = None) -> Budget:
    """The budget of a model opened in this process, or with `baseline`, in a process that
    holds that much before the model (a plan made for another run)."""
    ram = parse_size(ram_budget) if ram_budget is not None else default_ram_budget()
    resident = Decoder.resident_bytes(layout)
    kv = parallel * Decoder.cache_shape_for(layout.config).nbytes(ctx, kv_quant)
    scratch = scratch_bytes(layout)
    budget = Budget(ram, current_rss() if baseline is None else baseline, resident, kv, scratch, 0)
    if budget.fixed > ram:
        raise BudgetError(
            f"--ram-budget {format_size(ram)} cannot hold the resident weights ({format_size(resident)}) + KV cache "
            f"({format_size(kv)} for {parallel} × --ctx {ctx}, {kv_quant}) + scratch ({format_size(scratch)}) + the runtime itself "
            f"({format_size(budget.baseline)}): needs at least {format_size(budget.fixed)}; lower --ctx or --parallel, or raise the budget"
        )
    room = ram - budget.fixed
    if expert_cache is None:
        budget.expert_cache = min(room, cache_bytes_for_all(layout))
    else:
        budget.expert_cache = parse_size(expert_cache)
        if budget.expert_cache > room:
            raise BudgetError(
                f"--expert-cache {format_size(budget.expert_cache)} does not fit: --ram-budget {format_size(ram)} leaves "
                f"{format_size(room)} after resident weights, KV cache, scratch and runtime"
            )
    return budget


def fitting_parallel(layout: ModelLayout, ctx: int, kv_quant: str, ram_budget=None, most: int = MOST_PARALLEL,
                     extra_per_slot: int = 0, reserved: int = 0, baseline: int | None = None) -> int:
    """The most KV slots (at most `most`) whose cache, and `extra_per_slot` bytes each, take at
    most a quarter of what the RAM budget leaves after resident weights, scratch, the runtime
    (this process, or `baseline` bytes) and `reserved` bytes: the rest stays for experts."""
    ram = parse_size(ram_budget) if ram_budget is not None else default_ram_budget()
    runtime = current_rss() if baseline is None else baseline
    room = ram - runtime - Decoder.resident_bytes(layout) - scratch_bytes(layout) - reserved
    per_slot = Decoder.cache_shape_for(layout.config).nbytes(ctx, kv_quant) + extra_per_slot
    return max(1, min(most, room // 4 // max(per_slot, 1)))


def slots_for(layout: ModelLayout, options: EngineOptions, jobs: int) -> int:
    """The KV slots a model opens: `options.parallel`, else the one default rule: as many as
    `fitting_parallel` gives, at most MOST_PARALLEL and the `jobs` (sequences the work has)."""
    if options.parallel is not None:
        return options.parallel
    return fitting_parallel(layout, options.ctx, options.kv_quant, options.ram_budget, max(1, min(jobs, MOST_PARALLEL)))


class Model:
    def __init__(self, path, options: EngineOptions = EngineOptions(), jobs: int = 1):
        self.layout = ModelLayout(path)
        self.config = c = self.layout.config
        self.options = options
        self.tuner = ThreadTuner(kernels.most_threads()) if options.threads == AUTO_THREADS else None
        if options.threads and self.tuner is None:
            kernels.set_threads(options.threads)
        ctx, kv_quant = options.ctx, options.kv_quant
        parallel = slots_for(self.layout, options, jobs)
        self.budget = plan_budget(self.layout, ctx, kv_quant, options.ram_budget, options.expert_cache, parallel)
        self.store = ExpertStore(self.layout, self.budget.expert_cache, max(c.n_experts_used, 1), options.cache_policy,
                                 prefetch=options.prefetch, io=options.io)
        self.decoder = Decoder(self.layout, self.store, ctx)
        # one KV slot per sequence that can run at once (`generate_many`, `scheduler`); the
        # single-sequence calls use the first
        shape = Decoder.cache_shape_for(c)
        # (float caches share a pool: a batch step attends over all of them in one call)
        self.slots = KVPool(shape, ctx, kv_quant, parallel).caches if kv_quant in FLOAT_KINDS else \
            [KVCache(shape, ctx, kv_quant) for _ in range(parallel)]
        self.cache = self.slots[0]
        self.ctx = ctx
        self._tokenizer = None
        self.timings = {"prompt_tokens": 0, "prompt_seconds": 0.0, "generated_tokens": 0, "generation_seconds": 0.0,
                        "time_to_first_token": None}

    # --- tokens in, logits out ------------------------------------------------------

    def prefill(self, token_ids, all_logits: bool = True) -> np.ndarray:
        """Logits [len(token_ids), vocab], or [1, vocab] for the last position only (the output
        matrix is the largest one: generating needs just that row); the tokens are appended to
        the KV cache, PREFILL_CHUNK at a time."""
        started = time.perf_counter()
        ids = self.checked_ids(token_ids)
        chunks = [self.tuned(False, lambda i=i: self.decoder.forward(ids[i:i + PREFILL_CHUNK], self.cache, all_logits))
                  for i in range(0, len(ids), PREFILL_CHUNK)]
        logits = np.concatenate(chunks) if all_logits else chunks[-1]
        self.timings["prompt_tokens"] += len(token_ids)
        self.timings["prompt_seconds"] += time.perf_counter() - started
        return logits

    def decode(self, token_id: int) -> np.ndarray:
        """Logits [vocab] for the position after `token_id`."""
        started = time.perf_counter()
        ids = self.checked_ids([token_id])
        logits = self.tuned(True, lambda: self.decoder.forward(ids, self.cache))[0]
        self.timings["generated_tokens"] += 1
        self.timings["generation_seconds"] += time.perf_counter() - started
        return logits

    def tuned(self, decoding: bool, run):
        """`run()` on the threads `--threads auto` chooses: a decode step on the tuner's count, timed
        for it; any other step on the best count found, which is also left set for the steps that
        do not come here (batches). Without a tuner: as the options set them."""
        if self.tuner is None:
            return run()
        threads = self.tuner.count() if decoding else self.tuner.best
        kernels.set_threads(threads)
        started = time.perf_counter()
        result = run()
        if decoding:
            self.tuner.timed(threads, time.perf_counter() - started)
            if self.tuner.best != threads:  # a trial's count, or a new choice
                kernels.set_threads(self.tuner.best)
        return result

    def checked_ids(self, token_ids) -> list[int]:
        """`token_ids` as ints, refused when empty, outside the vocabulary or longer than --ctx."""
        ids = [int(i) for i in token_ids]
        if not ids:
            raise PromptError("the prompt is empty: there is no token to continue from")
        vocab = self.config.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) > self.ctx:
            raise ContextOverflow(f"context full: the prompt's {len(ids)} tokens exceed --ctx {self.ctx}")
        return ids

    def prompt_bytes_limit(self) -> int:
        """Bytes beyond which no text can tokenize into --ctx tokens (with slack for normalizers
        that shorten a text before it is split)."""
        return self.ctx * self.tokenizer.max_token_bytes * NORMALIZER_SLACK

    def prompt_ids(self, prompt) -> list[int]:
        """The token ids of `prompt` (a string, or chat messages through the chat template); a
        prompt whose bytes could not fit the context in any tokenization is refused before it
        is tokenized."""
        tok = self.tokenizer
        text = prompt if isinstance(prompt, str) else tok.apply_chat_template(prompt, add_generation_prompt=True)
        limit = self.prompt_bytes_limit()
        if len(text) > limit or len(text.encode("utf-8")) > limit:
            raise ContextOverflow(f"context full: the prompt's {len(text.encode('utf-8'))} bytes cannot fit --ctx {self.ctx} "
                                  f"tokens (a token of this vocabulary is at most {tok.max_token_bytes} bytes)")
        ids = tok.encode(text) if isinstance(prompt, str) else tok.encode(text, add_bos=False)
        if len(ids) > self.ctx:
            raise ContextOverflow(f"context full: the prompt's {len(ids)} tokens exceed --ctx {self.ctx}")
        return ids

    def reset(self) -> None:
        self.cache.length = 0

    def close(self) -> None:
        """Stop the prefetcher and close the expert files."""
        self.store.close()

    def trace_routing(self, file) -> None:
        """Write a JSON line per token per MoE layer to `file`: the forward step and its row
        that token was, its position, the layer, expert ids and weights."""
        last = {"step": -1, "layer": None}  # a step logs each MoE layer once, in order

        def log(layer, positions, ids, weights):
            if last["layer"] is None or layer <= last["layer"]:
                last["step"] += 1
            last["layer"] = layer
            for row, (position, experts, expert_weights) in enumerate(zip(positions, ids, weights)):
                record = {"step": last["step"], "row": row, "position": int(position), "layer": layer,
                          "experts": [int(e) for e in experts], "weights": [round(float(w), 6) for w in expert_weights]}
                file.write(json.dumps(record) + "\n")

        self.decoder.route_log = log

    @property
    def position(self) -> int:
        return self.cache.length

    # --- text ----------------------------------------------------------------------

    @property
    def has_tokenizer(self) -> bool:
        return (self.layout.directory / "tokenizer.json").is_file()

    @property
    def eos_ids(self) -> set[int]:
        """The tokens that end a sequence (none for a model folder without a tokenizer)."""
        return self.tokenizer.eos_ids if self.has_tokenizer else set()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from colibri.runtime.text import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self.layout.directory)
        return self._tokenizer

    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int | None = None):
        """Yield text as it is produced for `prompt` (a string, or chat messages)."""
        from colibri.runtime.sampling import Sampler, SamplingParams

        sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed))
        tok = self.tokenizer
        ids = self.prompt_ids(prompt)
        self.reset()
        started = time.perf_counter()
        logits = self.prefill(ids, all_logits=False)[-1]
        self.timings["time_to_first_token"] = time.perf_counter() - started
        stream = tok.stream()
        for _ in range(max_tokens):
            token = sampler(logits)
            if token in tok.eos_ids:
                break
            piece = stream.push(token)
            if piece:
                yield piece
            if self.position >= self.ctx:
                break
            logits = self.decode(token)

    def scheduler(self, keep_logits: bool = False):
        """A `runtime.batch.Scheduler` over this model's KV slots (`add`, `step`, `cancel`)."""
        from colibri.runtime.batch import Scheduler

        return Scheduler(self, keep_logits)

    def generate_many(self, prompts, max_tokens: int = 256, **sampling):
        """Yield (index, text piece) as the sequences of `prompts` (strings, chat messages or
        token ids) produce them, as many at once as the model has KV slots (`parallel`);
        `sampling` as `generate` takes it (plus `stop`), for every prompt. Each sequence's
        output is the same whatever runs beside it."""
        scheduler = self.scheduler()
        index = {scheduler.add(prompt, max_tokens, **sampling): i for i, prompt in enumerate(prompts)}
        while scheduler.busy:
            for event in scheduler.step():
                if event.text:
                    yield index[event.sequence], event.text

    # --- numbers -------------------------------------------------------------------

    def stats(self) -> dict:
        t = self.timings
        tokens = t["prompt_tokens"] + t["generated_tokens"]
        store = self.store.stats()
        return {
            "prompt_tokens": t["prompt_tokens"],
            "prompt_tok_per_s": t["prompt_tokens"] / t["prompt_seconds"] if t["prompt_seconds"] else None,
            "generated_tokens": t["generated_tokens"],
            "generation_tok_per_s": t["generated_tokens"] / t["generation_seconds"] if t["generation_seconds"] else None,
            "time_to_first_token_s": t["time_to_first_token"],
            **store,
            "expert_bytes_read_per_token": store["expert_bytes_read"] / tokens if tokens else 0.0,
            "resident_bytes": self.budget.resident,
            "kv_cache_bytes": self.cache.nbytes,
            "ram_budget_bytes": self.budget.ram,
            "peak_rss_bytes": peak_rss(),
            "threads": self.tuner.best if self.tuner else kernels.thread_count(),
            "kernels": kernels.kernel_paths(),
        }


def open_model(path, options: EngineOptions | None = None, *, jobs: int = 1, **changes) -> Model:
    """Open a converted model with `options` (`EngineOptions`; keyword `changes` replace its
    fields: `open_model(path, ctx=8192, ram_budget="24G")`); refuses a RAM budget that cannot
    hold it (see `plan_budget`). Without `parallel`, the KV slots follow `slots_for`, with
    `jobs` the sequences the caller will run at once (`generate_many`, `scheduler`)."""
    options = (options or EngineOptions()).replace(**changes)
    return Model(path, options, jobs)
