"""The router's /metrics: its own counters, and each instance's health and in-flight load at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.kv_events.subscriber import KVEventSubscriber
from pdserve.router.prefill_decider import Decision
from pdserve.router.registry import Registry


class RouterMetrics:
    def __init__(self, registry: Registry, kv_events: KVEventSubscriber | None = None) -> None:
        self.prometheus = CollectorRegistry()
        r = self.prometheus
        self.requests = Counter("pdserve_router_requests", "requests answered, by HTTP status", ["status"], registry=r)
        self.failed = Counter("pdserve_router_requests_failed", "requests answered with an error, by its OpenAI type "
                              "(server_overloaded: admission; rate_limit_exceeded; pd_error; ...)", ["reason"],
                              registry=r)
        self.retries = Counter("pdserve_router_retries", "requests tried again on another route", registry=r)
        self.refused = Counter("pdserve_router_refused", "refused: bad registration signature, too large "
                               "(a bad API key is refused before routing and not counted)", ["reason"], registry=r)
        self.prefill_decisions = Counter(
            "pdserve_router_prefill_decisions", "--pd-policy conditional: where PD requests' prompts were computed "
            "(remote: the prefill instance; local: the decode instance) and why", ["where", "reason"], registry=r)
        self.migrations = Counter(
            "pdserve_router_migrations", "streams that broke mid-answer and were resumed on another route "
            "(outcome resumed) or could not be (failed)", ["outcome"], registry=r)
        self.migration_seconds = Histogram(
            "pdserve_router_migration_seconds", "from a stream's failure to its first event from the new route",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.cached_tokens = Counter(
            "pdserve_router_cached_prompt_tokens", "prompt tokens found in the prefix cache of the instance that "
            "computed the prompt, as cache_aware predicted and as the engine reported (answers with usage: "
            "non-streamed ones and every prefill instance's)", ["source"], registry=r)
        r.register(_InstanceCollector(registry))
        if kv_events is not None:
            r.register(_KVEventCollector(kv_events))

    def count_cached(self, predicted: int, reported: int) -> None:
        self.cached_tokens.labels("predicted").inc(predicted)
        self.cached_tokens.labels("reported").inc(reported)

    def count_migration(self, resumed: bool, seconds: float) -> None:
        self.migrations.labels("resumed" if resumed else "failed").inc()
        if resumed:
            self.migration_seconds.observe(seconds)

    def count_decision(self, decision: Decision) -> None:
        self.prefill_decisions.labels("local" if decision.local else "remote", decision.reason).inc()


class _InstanceCollector:
    def __init__(self, registry: Registry, kv_events: KVEventSubscriber | None = None) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        labels = ["url", "role"]
        healthy = GaugeMetricFamily("pdserve_router_instance_healthy", "1 if the instance is in the pool",
                                    labels=labels)
        requests = GaugeMetricFamily("pdserve_router_instance_in_flight_requests", "requests in flight", labels=labels)
        tokens = GaugeMetricFamily("pdserve_router_instance_in_flight_tokens", "prompt tokens in flight",
                                   labels=labels)
        for i in self.registry.all():
            healthy.add_metric([i.url, i.role], float(i.healthy))
            requests.add_metric([i.url, i.role], i.in_flight_requests)
            tokens.add_metric([i.url, i.role], i.in_flight_tokens)
        yield from (healthy, requests, tokens)


class _KVEventCollector:
    def __init__(self, subscriber: KVEventSubscriber) -> None:
        self.subscriber = subscriber

    def collect(self) -> Iterator[Metric]:
        stats = self.subscriber.stats
        for name, value, doc in (
                ("batches", stats.batches, "KV event batches applied to the router's index"),
                ("events", stats.events, "KV events applied"),
                ("resyncs", stats.resyncs, "replays asked after a gap in an engine's batch numbers"),
                ("snapshots", stats.snapshots, "replays answered with a snapshot of the engine's whole cache")):
            yield CounterMetricFamily(f"pdserve_router_kv_event_{name}", doc, value=value)
        yield GaugeMetricFamily("pdserve_router_kv_index_blocks", "distinct blocks in the router's KV index",
                                value=self.subscriber.index.num_blocks)
