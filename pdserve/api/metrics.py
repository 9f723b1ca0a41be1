"""Prometheus metrics of one instance: request outcomes and latencies here, engine state on scrape."""

from __future__ import annotations

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.api.async_engine import AsyncEngine
from pdserve.api.generation import Generation
from pdserve.engine.engine_client import EngineError

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "finished requests by outcome", ["finish_reason"], registry=r)
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
        self.running = Gauge("pdserve_num_requests_running", "requests in the running batch", registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "requests waiting for admission", registry=r)
        self.kv_usage = Gauge("pdserve_kv_cache_usage_ratio", "share of KV blocks in use", registry=r)
        self.free_blocks = Gauge("pdserve_kv_cache_free_blocks", "free KV blocks", registry=r)
        self.prefix_queries = Gauge("pdserve_prefix_cache_queried_tokens", "prompt tokens looked up", registry=r)
        self.prefix_hits = Gauge("pdserve_prefix_cache_hit_tokens", "prompt tokens served from cache", registry=r)
        self.prefix_hit_rate = Gauge("pdserve_prefix_cache_hit_rate", "hit tokens / queried tokens", registry=r)
        self.preemptions = Gauge("pdserve_num_preemptions", "requests preempted so far", registry=r)
        self.total_blocks = Gauge("pdserve_kv_cache_total_blocks", "KV blocks in the cache", registry=r)
        # PD disaggregation (prefill instances send, decode instances receive)
        self.kv_sent = Gauge("pdserve_kv_transfer_bytes_sent", "KV bytes written into decode instances", registry=r)
        self.kv_received = Gauge("pdserve_kv_transfer_bytes_received", "KV bytes received from prefill instances",
                                 registry=r)
        self.transfers_ok = Gauge("pdserve_kv_transfers_ok", "KV transfers completed", registry=r)
        self.transfers_failed = Gauge("pdserve_kv_transfers_failed", "KV transfers that failed", registry=r)
        self.transfer_seconds = Histogram("pdserve_kv_transfer_seconds",
                                          "prefill: first scheduled to last layer written; decode: cache info "
                                          "sent to prefill done", buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_gbps = Gauge("pdserve_kv_transfer_gbps", "KV bytes over transfer seconds, last refresh",
                                   registry=r)
        self.preallocated = Gauge("pdserve_num_requests_preallocated",
                                  "decode: requests holding blocks while their KV arrives", registry=r)
        self.queued_for_blocks = Gauge("pdserve_num_requests_queued_for_blocks",
                                       "decode: PD requests waiting for free blocks", registry=r)
        self.transfers_by_protocol = Gauge("pdserve_kv_transfers_by_protocol",
                                           "prefill: KV transfers completed, by transport", ["protocol"], registry=r)
        self.refused_control = Gauge("pdserve_pd_refused_control_messages",
                                     "control messages refused: forged, replayed or from another cluster", registry=r)
        self.refused_kv = Gauge("pdserve_kv_refused_connections",
                                "decode: KV data connections refused (no or another --cluster-secret)", registry=r)
        self.blocks_skipped = Gauge("pdserve_kv_blocks_skipped",
                                    "decode: prompt blocks not transferred, found in this instance's prefix cache",
                                    registry=r)
        # decode role with --splitwise-cache-buffer-size (seed 002)
        self.buffer_blocks = Gauge("pdserve_splitwise_buffer_blocks", "blocks of the splitwise cache buffer",
                                   registry=r)
        self.buffer_used = Gauge("pdserve_splitwise_buffer_blocks_used", "buffer blocks holding KV", registry=r)
        self.buffered = Gauge("pdserve_num_requests_buffered",
                              "PD requests whose KV is in the buffer, waiting for (or being copied to) cache blocks",
                              registry=r)
        self.swap_in_bytes = Gauge("pdserve_kv_swap_in_bytes", "KV bytes copied buffer -> cache", registry=r)
        self.swap_in_seconds = Histogram("pdserve_kv_swap_in_seconds", "one request's copy buffer -> cache",
                                         buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1), registry=r)
        self.buffer_wait_seconds = Histogram("pdserve_splitwise_buffer_wait_seconds",
                                             "KV complete in the buffer -> copy into the cache started",
                                             buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30), registry=r)
        # the host prefix tier (--swap-space)
        self.host_blocks = Gauge("pdserve_host_cache_blocks", "blocks of the host prefix tier", registry=r)
        self.host_used = Gauge("pdserve_host_cache_blocks_used", "host tier blocks holding KV (or being written)",
                               registry=r)
        self.host_hits = Gauge("pdserve_host_cache_hit_blocks", "prompt blocks served from the host tier",
                               registry=r)
        self.host_swap_ins = Gauge("pdserve_host_cache_swap_in_blocks", "blocks copied host tier -> cache",
                                   registry=r)
        self.host_swap_outs = Gauge("pdserve_host_cache_swap_out_blocks", "blocks copied cache -> host tier",
                                    registry=r)
        self.host_swap_in_seconds = Gauge("pdserve_host_cache_swap_in_seconds",
                                          "engine time spent waiting for host tier -> cache copies", registry=r)
        # --speculative-config (vLLM's spec_decode names)
        self.spec_drafts = Gauge("pdserve_spec_decode_num_drafts", "sequence steps that carried proposals",
                                 registry=r)
        self.spec_draft_tokens = Gauge("pdserve_spec_decode_num_draft_tokens", "tokens proposed", registry=r)
        self.spec_accepted = Gauge("pdserve_spec_decode_num_accepted_tokens", "proposed tokens accepted", registry=r)
        self.spec_accepted_per_pos = Gauge("pdserve_spec_decode_num_accepted_tokens_per_pos",
                                           "proposals accepted at each position of a proposal", ["position"],
                                           registry=r)
        self._last_bytes = 0

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
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        if t.first_token is not None and t.last_token is not None and gen.completion_tokens > 1:
            self.tpot.observe((t.last_token - t.first_token) / (gen.completion_tokens - 1))

    async def render(self, engine: AsyncEngine) -> Response:
        await self.refresh(engine)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def refresh(self, engine: AsyncEngine) -> None:
        """Set the engine gauges from a fresh `stats` call (left as they were if the engine cannot answer)."""
        try:
            stats = await engine.call("stats")
        except (EngineError, TimeoutError):
            stats = None
        if stats:
            self.running.set(stats["running"])
            self.waiting.set(stats["waiting"])
            self.kv_usage.set(stats["kv_usage"])
            self.free_blocks.set(stats["free_blocks"])
            self.prefix_queries.set(stats["prefix_cache_queried_tokens"])
            self.prefix_hits.set(stats["prefix_cache_hit_tokens"])
            q = stats["prefix_cache_queried_tokens"]
            self.prefix_hit_rate.set(stats["prefix_cache_hit_tokens"] / q if q else 0.0)
            self.preemptions.set(stats["num_preemptions"])
            self.total_blocks.set(stats["num_blocks"])
            self.preallocated.set(stats["preallocated"])
            if "host_blocks" in stats:
                self._refresh_host_tier(stats)
            if "kv_bytes_sent" in stats:
                self._refresh_pd(stats)
            if "spec_decode_num_drafts" in stats:
                self._refresh_spec_decode(stats)

    def _refresh_spec_decode(self, stats: dict) -> None:
        self.spec_drafts.set(stats["spec_decode_num_drafts"])
        self.spec_draft_tokens.set(stats["spec_decode_num_draft_tokens"])
        self.spec_accepted.set(stats["spec_decode_num_accepted_tokens"])
        for pos, n in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            self.spec_accepted_per_pos.labels(position=str(pos)).set(n)

    def _refresh_host_tier(self, stats: dict) -> None:
        self.host_blocks.set(stats["host_blocks"])
        self.host_used.set(stats["host_blocks_used"])
        self.host_hits.set(stats["host_hit_blocks"])
        self.host_swap_ins.set(stats["host_swap_in_blocks"])
        self.host_swap_outs.set(stats["host_swap_out_blocks"])
        self.host_swap_in_seconds.set(stats["host_swap_in_seconds"])

    def _refresh_pd(self, stats: dict) -> None:
        self.kv_sent.set(stats["kv_bytes_sent"])
        self.kv_received.set(stats["kv_bytes_received"])
        self.transfers_ok.set(stats["kv_transfers_ok"])
        self.transfers_failed.set(stats["kv_transfers_failed"])
        self.queued_for_blocks.set(stats.get("pd_queued_for_blocks", 0))
        self.refused_control.set(stats.get("pd_refused_control_messages", 0))
        self.refused_kv.set(stats.get("kv_refused_connections", 0))
        self.blocks_skipped.set(stats.get("pd_kv_blocks_skipped", 0))
        if "pd_buffer_blocks" in stats:
            self.buffer_blocks.set(stats["pd_buffer_blocks"])
            self.buffer_used.set(stats["pd_buffer_blocks_used"])
            self.buffered.set(stats["pd_buffered_requests"])
            self.swap_in_bytes.set(stats["kv_swap_in_bytes"])
            for s in stats["kv_swap_in_seconds"]:
                self.swap_in_seconds.observe(s)
            for s in stats["pd_buffer_wait_seconds"]:
                self.buffer_wait_seconds.observe(s)
        for protocol, n in stats.get("kv_transfers_by_protocol", {}).items():
            self.transfers_by_protocol.labels(protocol).set(n)
        seconds = stats["kv_transfer_seconds"]
        for s in seconds:
            self.transfer_seconds.observe(s)
        moved = stats["kv_bytes_sent"] + stats["kv_bytes_received"]
        if seconds and sum(seconds) > 0:
            self.transfer_gbps.set((moved - self._last_bytes) / sum(seconds) / 1e9)
        self._last_bytes = moved
