"""`/metrics`: Prometheus text built at scrape time from the engine's `cache_stats()` and the server's
request counters, in a registry of the app's own (no global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.serve.bridge import EngineBridge

# cache_stats() keys that only ever grow are counters; the rest are gauges.
COUNTERS = ("computed_prompt_tokens", "cached_prompt_tokens", "generated_tokens", "recomputed_tokens",
            "preemptions", "offloaded_pages", "restored_pages", "offload_fallbacks", "recycled_pages",
            "spec_draft_tokens", "spec_accepted_tokens")


class EngineCollector:
    """Yields one metric per numeric `cache_stats()` field, plus request counts and the weight version."""

    def __init__(self, bridge: EngineBridge) -> None:
        self.bridge = bridge

    def collect(self):
        stats = self.bridge.cache_stats()
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in COUNTERS:
                yield CounterMetricFamily(f"rollout_{key}", f"cache_stats()['{key}']", value=value)
            else:
                yield GaugeMetricFamily(f"rollout_{key}", f"cache_stats()['{key}']", value=value)
        for key, value in self.bridge.counters.items():
            yield CounterMetricFamily(f"rollout_server_{key}", f"{key} received by the server", value=value)
        yield GaugeMetricFamily("rollout_weight_version", "the engine's policy_version",
                                value=self.bridge.weight_version)
        yield GaugeMetricFamily("rollout_paused", "1 while paused", value=int(self.bridge.is_paused()))


def make_registry(bridge: EngineBridge) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(bridge))
    return registry
