"""Prometheus metrics of the Serve app, rendered by the ingress at /metrics: its own request, token and
time-to-first-token series, and each base's engine counters (adapter loads, evictions, cache bytes by layer type)
read from the engine replicas when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    """Exposes the latest engine stats snapshot ({base: Engine.stats()}) as metric families."""

    def __init__(self):
        self.snapshot: dict[str, dict] = {}

    def collect(self):
        loads = CounterMetricFamily("moetune_serve_adapter_loads", "Adapters loaded from storage", labels=["base"])
        evictions = CounterMetricFamily("moetune_serve_adapter_evictions", "Adapters evicted (least recently used)",
                                        labels=["base"])
        failures = CounterMetricFamily("moetune_serve_adapter_load_failures", "Adapters that could not be loaded",
                                       labels=["base"])
        loaded = GaugeMetricFamily("moetune_serve_adapters_loaded", "Adapters held by the replica", labels=["base"])
        cache = GaugeMetricFamily("moetune_serve_cache_bytes", "Generation cache bytes held, by layer type",
                                  labels=["base", "layer_type"])
        for base, stats in self.snapshot.items():
            loads.add_metric([base], stats.get("adapter_loads", 0))
            evictions.add_metric([base], stats.get("adapter_evictions", 0))
            failures.add_metric([base], stats.get("adapter_load_failures", 0))
            loaded.add_metric([base], stats.get("adapters_loaded", 0))
            for layer_type, nbytes in (stats.get("cache_bytes") or {}).items():
                cache.add_metric([base, layer_type], nbytes)
        yield from (loads, evictions, failures, loaded, cache)


class ServeMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("moetune_serve_requests", "Inference requests answered",
                                ["endpoint", "status"], registry=self.registry)
        self.tokens = Counter("moetune_serve_generated_tokens", "Tokens generated (rate() gives tokens/s)",
                              ["base"], registry=self.registry)
        self.ttft = Histogram("moetune_serve_time_to_first_token_seconds", "From request to its first token",
                              ["base"], registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.engines = _EngineCollector()
        self.registry.register(self.engines)

    def render(self, engine_stats: dict[str, dict]) -> bytes:
        self.engines.snapshot = engine_stats
        return generate_latest(self.registry)
