"""`/metrics`: the engine's numbers in Prometheus' text format, read at each scrape."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        counters, store = engine.scheduler.counters, engine.model.store.stats()
        busy = counters["seconds"]
        yield GaugeMetricFamily("colibri_active_sequences", "sequences holding a KV slot", value=engine.active())
        yield GaugeMetricFamily("colibri_queue_depth", "requests waiting for a slot", value=engine.waiting())
        yield GaugeMetricFamily("colibri_slots", "KV slots (--parallel)", value=len(engine.model.slots))
        yield CounterMetricFamily("colibri_generated_tokens", "tokens generated", value=counters["generated_tokens"])
        yield CounterMetricFamily("colibri_prompt_tokens", "prompt tokens read", value=counters["prompt_tokens"])
        yield GaugeMetricFamily("colibri_tok_per_s", "generated tokens per second of engine work (aggregate)",
                                value=counters["generated_tokens"] / busy if busy else 0.0)
        yield GaugeMetricFamily("colibri_busy_share", "share of the time since start the engine was stepping",
                                value=busy / max(time.monotonic() - engine.started, 1e-9))
        yield GaugeMetricFamily("colibri_expert_hit_rate", "expert cache hit rate", value=store["expert_hit_rate"])
        yield CounterMetricFamily("colibri_expert_bytes_read", "expert bytes read from disk", value=store["expert_bytes_read"])


def registry_for(engine) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry
