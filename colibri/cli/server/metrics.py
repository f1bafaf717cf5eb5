"""`/metrics`: the engine's numbers in Prometheus' text format, read at each scrape."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def engine_numbers(engine) -> dict:
    """The engine's numbers as `/metrics` and the live page's `/live.json` give them."""
    counters, store = engine.scheduler.counters, engine.model.store.stats()
    busy, uptime = counters["seconds"], time.monotonic() - engine.started
    return {"active": engine.active(), "queued": engine.waiting(), "slots": len(engine.model.slots),
            "generated_tokens": counters["generated_tokens"], "prompt_tokens": counters["prompt_tokens"],
            "tok_per_s": counters["generated_tokens"] / busy if busy else 0.0,
            "busy_share": busy / max(uptime, 1e-9), "uptime_s": uptime,
            "expert_hit_rate": store["expert_hit_rate"], "expert_bytes_read": store["expert_bytes_read"],
            "io": store["io"]}


class EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        n = engine_numbers(self.engine)
        yield GaugeMetricFamily("colibri_active_sequences", "sequences holding a KV slot", value=n["active"])
        yield GaugeMetricFamily("colibri_queue_depth", "requests waiting for a slot", value=n["queued"])
        yield GaugeMetricFamily("colibri_slots", "KV slots (--parallel)", value=n["slots"])
        yield CounterMetricFamily("colibri_generated_tokens", "tokens generated", value=n["generated_tokens"])
        yield CounterMetricFamily("colibri_prompt_tokens", "prompt tokens read", value=n["prompt_tokens"])
        yield GaugeMetricFamily("colibri_tok_per_s", "generated tokens per second of engine work (aggregate)",
                                value=n["tok_per_s"])
        yield GaugeMetricFamily("colibri_busy_share", "share of the time since start the engine was stepping",
                                value=n["busy_share"])
        yield GaugeMetricFamily("colibri_expert_hit_rate", "expert cache hit rate", value=n["expert_hit_rate"])
        yield CounterMetricFamily("colibri_expert_bytes_read", "expert bytes read from disk", value=n["expert_bytes_read"])


def registry_for(engine) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry
