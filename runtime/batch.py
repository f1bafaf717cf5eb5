"""Many sequences at once: KV slots, continuous batching, and steps that keep each row's bits.

Each sequence owns one of the model's `parallel` KV slots (caches of --ctx positions,
preallocated and counted in the RAM budget). A `Scheduler.step` pushes the next token of every
decoding sequence, plus the next STEP_PROMPT_TOKENS tokens of sequences still reading their prompt
(as many chunks as STEP_TOKENS leaves room for), through the model together
(`Decoder.forward_batch`): each MoE layer reads the union of their experts once. A finished
sequence frees its slot for the next queued one.

Batch invariance: a prompt is cut at fixed positions (multiples of STEP_PROMPT_TOKENS) and every row
is computed as it would be alone, so a sequence's logits, and with its own sampler seed its
tokens, do not depend on what else runs, in which slot, or when it was admitted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from colibri.runtime.sampling import Sampler, SamplingParams

STEP_PROMPT_TOKENS = 64  # prompt tokens of one sequence per batch step (engine.PREFILL_CHUNK: per pass of one prompt)
STEP_TOKENS = 256  # rows of one step at most (one decoding sequence's token is one row)


@dataclass
class Event:
    """What a step did for one sequence: a sampled token and the text it completed (text is
    "" while a character is split across tokens), and `finish_reason` when the sequence ended
    ("stop": an end-of-sequence token or a stop string; "length": max_tokens or the context
    end; "cancelled"), with the sequence's `numbers` (`Sequence.numbers`). `logits` [vocab]
    of the token, when the scheduler keeps them."""

    sequence: int
    token: int | None
    text: str
    finish_reason: str | None = None
    logits: np.ndarray | None = None
    numbers: dict | None = None


@dataclass(eq=False)  # a sequence is itself, not its fields
class Sequence:
    id: int
    prompt: list[int]
    sampler: Sampler
    max_tokens: int
    stop: tuple[str, ...]
    stream: object
    ignore_eos: bool = False
    slot: int | None = None
    read: int = 0  # prompt tokens in the KV cache
    generated: list[int] = field(default_factory=list)
    held: str = ""  # text held back: it may be the start of a stop string
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None

    @property
    def decoding(self) -> bool:
        return self.read == len(self.prompt)

    def numbers(self) -> dict:
        """Token counts and rates of this sequence."""
        decode_seconds = (self.finished or time.perf_counter()) - (self.first_token or self.admitted or 0)
        return {"prompt_tokens": len(self.prompt), "generated_tokens": len(self.generated),
                "time_to_first_token_s": self.first_token - self.admitted if self.first_token else None,
                "generation_tok_per_s": (len(self.generated) - 1) / decode_seconds
                if len(self.generated) > 1 and decode_seconds > 0 else None,
                "finish_reason": self.finish_reason}


class Scheduler:
    """Drives a model's KV slots: `add` queues a prompt, `step` advances every running sequence
    by one token (or one prompt chunk) and returns their events, `cancel` ends one."""

    def __init__(self, model, keep_logits: bool = False, slots: list | None = None, step_tokens: int = STEP_TOKENS):
        """Over `slots` (default: the model's KV slots), at most `step_tokens` rows a step."""
        self.model, self.keep_logits = model, keep_logits
        self.slots = model.slots if slots is None else slots
        self.step_tokens = step_tokens
        self.free = list(range(len(self.slots)))
        self.queue: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}  # queued and running, by id
        self.counters = dict(steps=0, rows=0, prompt_tokens=0, generated_tokens=0, distinct_experts=0, seconds=0.0)
        self._next_id = 0

    # --- requests ------------------------------------------------------------------

    def add(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
            min_p: float = 0.0, seed: int | None = None, stop=(), ignore_eos: bool = False) -> int:
        """Queue `prompt` (text, chat messages, or token ids); returns the sequence's id.
        `ignore_eos` decodes past end-of-sequence tokens (benchmarks, as llama.cpp's
        --ignore-eos). Raises PromptError / ContextOverflow for a prompt the model cannot take."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be non-empty strings")
        ids = self.model.checked_ids(self.model.prompt_ids(prompt) if _is_text(prompt) else prompt)
        stream = self.model.tokenizer.stream() if self.model.has_tokenizer else None
        sequence = Sequence(self._next_id, ids, Sampler(params), max_tokens, stop, stream, ignore_eos)
        self._next_id += 1
        self.sequences[sequence.id] = sequence
        self.queue.append(sequence)
        return sequence.id

    def cancel(self, sequence_id: int) -> Event | None:
        """End a queued or running sequence (its slot is freed); None if it had already ended."""
        sequence = self.sequences.get(sequence_id)
        if sequence is None:
            return None
        if sequence in self.queue:
            self.queue.remove(sequence)
        return self._finish(sequence, "cancelled", None, sequence.held)

    @property
    def busy(self) -> bool:
        """Whether a sequence is queued or running."""
        return bool(self.queue or self.running)

    # --- one step ------------------------------------------------------------------

    def admit(self) -> list[Sequence]:
        """Move queued sequences into free slots; returns them."""
        admitted, now = [], time.perf_counter()
        while self.free and self.queue:
            sequence = self.queue.popleft()
            sequence.slot, sequence.admitted = self.free.pop(0), now
            self.slots[sequence.slot].length = 0
            self.running.append(sequence)
            admitted.append(sequence)
        return admitted

    def step(self, admit: bool = True) -> list[Event]:
        """One forward pass over every running sequence (admitting queued ones into free slots
        first, unless not `admit`)."""
        started = time.perf_counter()
        if admit:
            self.admit()
        batch, members, rows = [], [], 0
        for sequence in self.running:  # decoding sequences first: one row each
            if sequence.decoding:
                batch.append(([sequence.generated[-1]], self.slots[sequence.slot]))
                members.append(sequence)
                rows += 1
        for sequence in self.running:
            if not sequence.decoding:
                chunk = sequence.prompt[sequence.read:sequence.read + STEP_PROMPT_TOKENS]
                if rows and rows + len(chunk) > self.step_tokens:
                    break
                batch.append((chunk, self.slots[sequence.slot]))
                members.append(sequence)
                rows += len(chunk)
        if not batch:
            return []
        logits = self.model.tuned(rows == len(batch), lambda: self.model.decoder.forward_batch(batch))
        events = []
        for sequence, (tokens, _), row in zip(members, batch, logits):
            if not sequence.decoding:
                sequence.read += len(tokens)
                self.counters["prompt_tokens"] += len(tokens)
                if not sequence.decoding:
                    continue  # more of its prompt to read
            events.append(self._sample(sequence, row))
        self._count_step(rows, started)
        return events

    def _count_step(self, rows: int, started: float) -> None:
        c = self.counters
        c["steps"] += 1
        c["rows"] += rows
        c["distinct_experts"] += self.model.decoder.distinct_experts()
        c["seconds"] += time.perf_counter() - started

    def _sample(self, sequence: Sequence, logits: np.ndarray) -> Event:
        token = sequence.sampler(logits)
        kept = logits.copy() if self.keep_logits else None
        now = time.perf_counter()
        if sequence.first_token is None:
            sequence.first_token = now
        if token in self.model.eos_ids and not sequence.ignore_eos:
            return self._finish(sequence, "stop", token, sequence.held, kept)
        sequence.generated.append(token)
        self.counters["generated_tokens"] += 1
        text = sequence.held + (sequence.stream.push(token) if sequence.stream is not None else "")
        cut = min((i for i in (text.find(s) for s in sequence.stop) if i >= 0), default=-1)
        if cut >= 0:
            return self._finish(sequence, "stop", token, text[:cut], kept)
        cache = self.slots[sequence.slot]
        if len(sequence.generated) >= sequence.max_tokens or cache.length >= cache.ctx:
            return self._finish(sequence, "length", token, text, kept)
        # hold back a tail that could be the start of a stop string
        hold = max((k for s in sequence.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        sequence.held = text[len(text) - hold:] if hold else ""
        return Event(sequence.id, token, text[:len(text) - hold], None, kept)

    def _finish(self, sequence: Sequence, reason: str, token, text: str, logits=None) -> Event:
        """End `sequence` with its last `text` (what it still held back, where that is not cut)."""
        sequence.held = ""
        sequence.finish_reason, sequence.finished = reason, time.perf_counter()
        if sequence in self.running:
            self.running.remove(sequence)
            self.free.append(sequence.slot)
            self.free.sort()
        del self.sequences[sequence.id]
        return Event(sequence.id, token, text, reason, logits, sequence.numbers())

    # --- numbers -------------------------------------------------------------------

    def stats(self) -> dict:
        """Aggregate numbers of every step so far, with the expert store's."""
        c = self.counters
        store = self.model.store.stats()
        tokens = c["prompt_tokens"] + c["generated_tokens"]
        return {
            "steps": c["steps"],
            "prompt_tokens": c["prompt_tokens"],
            "generated_tokens": c["generated_tokens"],
            "tok_per_s": c["generated_tokens"] / c["seconds"] if c["seconds"] else None,
            "rows_per_step": c["rows"] / c["steps"] if c["steps"] else None,
            "distinct_experts_per_step": c["distinct_experts"] / c["steps"] if c["steps"] else None,
            "expert_bytes_read_per_generated_token":
                store["expert_bytes_read"] / c["generated_tokens"] if c["generated_tokens"] else None,
            "expert_bytes_read_per_token": store["expert_bytes_read"] / tokens if tokens else 0.0,
            **store,
        }


STEP_WEIGHTED = {"rows_per_step": "steps", "distinct_experts_per_step": "steps",
                 "prefetch_accuracy": "prefetched_experts", "read_hidden_share": "read_seconds"}
SUMMED = ("steps", "prompt_tokens", "generated_tokens", "expert_hits", "expert_misses", "expert_bytes_read",
          "expert_evictions", "prefetched_experts", "read_seconds", "expert_resident_bytes", "expert_page_cache_bytes")


def merge_stats(parts: list[dict]) -> dict:
    """`Scheduler.stats` of schedulers that ran side by side (Ray actors, each with its own
    cache) as one: counts summed, tok/s the sum of their rates, the rest recomputed from the
    sums or weighted by what they are per; settings (cache size, policy, io) the first's. A
    number no part knows (None) stays unknown."""
    merged = {**parts[0], **{key: _sum_known(p[key] for p in parts) for key in SUMMED}}
    for key, weight in STEP_WEIGHTED.items():
        known = [p for p in parts if p[key] is not None and p[weight]]
        merged[key] = sum(p[key] * p[weight] for p in known) / sum(p[weight] for p in known) if known else None
    rates = [p["tok_per_s"] for p in parts if p["tok_per_s"] is not None]
    lookups = merged["expert_hits"] + merged["expert_misses"]
    tokens = merged["prompt_tokens"] + merged["generated_tokens"]
    merged.update(
        tok_per_s=sum(rates) if rates else None,
        expert_hit_rate=merged["expert_hits"] / lookups if lookups else 0.0,
        expert_bytes_read_per_generated_token=merged["expert_bytes_read"] / merged["generated_tokens"]
        if merged["generated_tokens"] else None,
        expert_bytes_read_per_token=merged["expert_bytes_read"] / tokens if tokens else 0.0)
    return merged


def _sum_known(values):
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _is_text(prompt) -> bool:
    """A string or chat messages, as opposed to token ids."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict))
