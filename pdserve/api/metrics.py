"""Prometheus metrics of one instance: request outcomes and latencies counted here; the engine's figures
(engine_metrics.py) as its ranks last reported them."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from pdserve.api.async_engine import AsyncEngine
from pdserve.api.data_parallel import DataParallelEngine
from pdserve.api.engine_metrics import EngineCollector
from pdserve.api.generation import Generation
from pdserve.engine.stats import LATENCY_BUCKETS


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "finished requests by outcome", ["finish_reason"], registry=r)
        self.failed = Counter("pdserve_requests_failed", "requests answered with an error, by its OpenAI type "
                              "(server_overloaded: admission; rate_limit_exceeded; invalid_request_error; ...)",
                              ["reason"], registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "requests being served", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "engine arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "mean gap between generated tokens",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "engine arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pdserve_request_queue_time_seconds", "engine arrival to first scheduled",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.engine = EngineCollector()  # the engine's figures, from the last `stats` of each rank
        r.register(self.engine)
        self.data_parallel = _DataParallelCollector()
        r.register(self.data_parallel)
        # --enable-role-switch (POST /role)
        self.role_changes = Counter("pdserve_role_changes", "role changes in place, by outcome (ok, failed: the "
                                    "instance stayed as it was)", ["from_role", "to_role", "outcome"], registry=r)
        self.role_change_seconds = Histogram("pdserve_role_change_seconds", "drain, switch and announce",
                                             buckets=LATENCY_BUCKETS, registry=r)

    def seed(self, engine: AsyncEngine | DataParallelEngine) -> None:
        """Every rank's figures as it reported them when ready: each series is there before the first refresh."""
        for rank, client in engine.rank_clients():
            if client.ready is not None and client.ready.stats is not None:
                self.engine.latest.setdefault(str(rank), client.ready.stats)

    def role_change(self, before: str, after: str, outcome: str, seconds: float) -> None:
        self.role_changes.labels(before, after, outcome).inc()
        self.role_change_seconds.observe(seconds)

    def request_started(self) -> None:
        self.in_flight.inc()

    def request_finished(self, gen: Generation, outcome: str | None = None) -> None:
        self.in_flight.dec()
        reason = outcome or gen.finish_reasons.get(0) or "abort"
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(len(gen.prompt_token_ids))
        self.generation_tokens.inc(gen.completion_tokens)
        t = gen.times.get(0)
        if t is None:
            return
        if t.first_scheduled is not None:
            self.queue.observe(t.first_scheduled - t.arrival)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        ttft, itl = gen.latencies()
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.tpot.observe(itl)

    async def render(self, engine: AsyncEngine | DataParallelEngine) -> Response:
        await self.refresh(engine)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def refresh(self, engine: AsyncEngine | DataParallelEngine) -> None:
        """Keep each rank's fresh `stats` answer for the next scrape (a rank that cannot answer keeps its last)."""
        for rank, stats in await engine.stats_by_rank():
            if stats is not None:
                self.engine.latest[str(rank)] = stats
        self.data_parallel.ranks = [(str(rank), served, restarts) for rank, served, restarts in engine.rank_counts()]


class _DataParallelCollector:
    """--data-parallel-size above 1: what the API server counts of its ranks."""

    def __init__(self) -> None:
        self.ranks: list[tuple[str, int, int]] = []  # (rank, requests sent to it, restarts)

    def collect(self) -> Iterator[Metric]:
        served = CounterMetricFamily("pdserve_data_parallel_requests", "requests sent to each data-parallel rank",
                                     labels=["dp_rank"])
        restarts = CounterMetricFamily("pdserve_data_parallel_restarts", "times a data-parallel rank's engine was "
                                       "started again", labels=["dp_rank"])
        for rank, n, r in self.ranks:
            served.add_metric([rank], n)
            restarts.add_metric([rank], r)
        yield from (served, restarts)
