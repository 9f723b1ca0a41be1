"""Prometheus metrics of one instance: request outcomes and latencies here, engine state on scrape."""

from __future__ import annotations

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.api.async_engine import AsyncEngine
from pdserve.api.data_parallel import DataParallelEngine
from pdserve.api.generation import Generation
from pdserve.engine.stats import EngineStats, HostTierStats, PDStats
from pdserve.spec_decode.stats import SpecDecodeCounts

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, data_parallel_size: int = 1) -> None:
        r = self.registry = CollectorRegistry()

        def ranked(name: str, doc: str) -> Gauge:
            """Engine state, one series per data-parallel rank, each there (at 0) from the start: a scrape while
            an engine is too busy to answer `stats` shows the last values, never no series."""
            gauge = Gauge(name, doc, ["dp_rank"], registry=r)
            for rank in range(data_parallel_size):
                gauge.labels(str(rank))
            return gauge

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
        self.running = ranked("pdserve_num_requests_running", "requests in the running batch")
        self.waiting = ranked("pdserve_num_requests_waiting", "requests waiting for admission")
        self.kv_usage = ranked("pdserve_kv_cache_usage_ratio", "share of KV blocks in use")
        self.free_blocks = ranked("pdserve_kv_cache_free_blocks", "free KV blocks")
        self.prefix_queries = ranked("pdserve_prefix_cache_queried_tokens", "prompt tokens looked up")
        self.prefix_hits = ranked("pdserve_prefix_cache_hit_tokens", "prompt tokens served from cache")
        self.prefix_hit_rate = ranked("pdserve_prefix_cache_hit_rate", "hit tokens / queried tokens")
        self.preemptions = ranked("pdserve_num_preemptions", "requests preempted so far")
        self.total_blocks = ranked("pdserve_kv_cache_total_blocks", "KV blocks in the cache")
        # PD disaggregation (prefill instances send, decode instances receive)
        self.kv_sent = ranked("pdserve_kv_transfer_bytes_sent", "KV bytes written into decode instances")
        self.kv_received = ranked("pdserve_kv_transfer_bytes_received", "KV bytes received from prefill instances")
        self.transfers_ok = ranked("pdserve_kv_transfers_ok", "KV transfers completed")
        self.transfers_failed = ranked("pdserve_kv_transfers_failed", "KV transfers that failed")
        self.transfer_seconds = Histogram("pdserve_kv_transfer_seconds",
                                          "prefill: first scheduled to last layer written; decode: cache info "
                                          "sent to prefill done", buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_gbps = ranked("pdserve_kv_transfer_gbps", "KV bytes over transfer seconds, last refresh")
        self.preallocated = ranked("pdserve_num_requests_preallocated",
                                  "decode: requests holding blocks while their KV arrives")
        self.queued_for_blocks = ranked("pdserve_num_requests_queued_for_blocks",
                                       "decode: PD requests waiting for free blocks")
        self.transfers_by_protocol = Gauge("pdserve_kv_transfers_by_protocol",
                                           "prefill: KV transfers completed, by transport", ["protocol"], registry=r)
        self.refused_control = ranked("pdserve_pd_refused_control_messages",
                                     "control messages refused: forged, replayed or from another cluster")
        self.refused_kv = ranked("pdserve_kv_refused_connections", "KV data connections and prefix-pull messages "
                                 "refused (no or another --cluster-secret)")
        self.blocks_skipped = ranked("pdserve_kv_blocks_skipped",
                                    "decode: prompt blocks not transferred, found in this instance's prefix cache")
        # decode role with --splitwise-cache-buffer-size (seed 002)
        self.buffer_blocks = ranked("pdserve_splitwise_buffer_blocks", "blocks of the splitwise cache buffer")
        self.buffer_used = ranked("pdserve_splitwise_buffer_blocks_used", "buffer blocks holding KV")
        self.buffered = ranked("pdserve_num_requests_buffered",
                               "PD requests whose KV is in the buffer, waiting for (or being copied to) cache blocks")
        self.swap_in_bytes = ranked("pdserve_kv_swap_in_bytes", "KV bytes copied buffer -> cache")
        self.swap_in_seconds = Histogram("pdserve_kv_swap_in_seconds", "one request's copy buffer -> cache",
                                         buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1), registry=r)
        self.buffer_wait_seconds = Histogram("pdserve_splitwise_buffer_wait_seconds",
                                             "KV complete in the buffer -> copy into the cache started",
                                             buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30), registry=r)
        # the host prefix tier (--swap-space)
        self.host_blocks = ranked("pdserve_host_cache_blocks", "blocks of the host prefix tier")
        self.host_used = ranked("pdserve_host_cache_blocks_used", "host tier blocks holding KV (or being written)")
        self.host_hits = ranked("pdserve_host_cache_hit_blocks", "prompt blocks served from the host tier")
        self.host_swap_ins = ranked("pdserve_host_cache_swap_in_blocks", "blocks copied host tier -> cache")
        self.host_swap_outs = ranked("pdserve_host_cache_swap_out_blocks", "blocks copied cache -> host tier")
        self.host_swap_in_seconds = ranked("pdserve_host_cache_swap_in_seconds",
                                          "engine time spent waiting for host tier -> cache copies")
        # the disk tier (--kv-disk-path)
        self.disk_blocks = ranked("pdserve_disk_cache_blocks", "blocks of the disk tier holding KV")
        self.disk_capacity = ranked("pdserve_disk_cache_capacity_blocks", "blocks the disk tier has room for")
        self.disk_hits = ranked("pdserve_disk_cache_hit_blocks", "prompt blocks served from the disk tier")
        self.disk_misses = ranked("pdserve_disk_cache_misses", "disk tier blocks found gone or damaged: computed")
        self.disk_load_seconds = ranked("pdserve_disk_cache_load_seconds",
                                        "engine time spent waiting for disk tier reads")
        self.prefix_hits_by_tier = Gauge("pdserve_prefix_cache_hit_tokens_by_tier",
                                         "prompt tokens served from cache, by where each block was: device, host, "
                                         "disk, pulled (from a peer)", ["dp_rank", "tier"], registry=r)
        # prefix pulls between instances (--enable-kv-pull)
        self.pulls = ranked("pdserve_kv_pulls", "prefix pulls asked of peers")
        self.pulled_blocks = ranked("pdserve_kv_pulled_blocks", "blocks prefix pulls brought")
        self.pulls_failed = ranked("pdserve_kv_pulls_failed",
                                   "prefix pulls that brought nothing (holder gone or evicted, timed out): computed")
        self.pulls_skipped = ranked("pdserve_kv_pulls_skipped",
                                    "routers' pull hints not followed: computing was cheaper")
        self.pull_seconds = ranked("pdserve_kv_pull_seconds", "engine time spent waiting for prefix pulls")
        self.pull_bandwidth = ranked("pdserve_kv_pull_bandwidth_bytes_per_second",
                                     "the pull bandwidth the cost rule assumes (measured by pulls)")
        self.prefill_rate = ranked("pdserve_prefill_tokens_per_second",
                                   "prompt tokens per second of the engine's steps that were mostly prompt (the "
                                   "pull cost rule's)")
        # --speculative-config (vLLM's spec_decode names)
        self.spec_drafts = ranked("pdserve_spec_decode_num_drafts", "sequence steps that carried proposals")
        self.spec_draft_tokens = ranked("pdserve_spec_decode_num_draft_tokens", "tokens proposed")
        self.spec_accepted = ranked("pdserve_spec_decode_num_accepted_tokens", "proposed tokens accepted")
        # --data-parallel-size above 1 only
        self.dp_served = Gauge("pdserve_data_parallel_requests", "requests sent to each data-parallel rank",
                               ["dp_rank"], registry=r)
        self.dp_restarts = Gauge("pdserve_data_parallel_restarts", "times a data-parallel rank's engine was started "
                                 "again", ["dp_rank"], registry=r)
        self.spec_accepted_per_pos = Gauge("pdserve_spec_decode_num_accepted_tokens_per_pos",
                                           "proposals accepted at each position of a proposal", ["position"],
                                           registry=r)
        # --enable-role-switch (POST /role)
        self.role_changes = Counter("pdserve_role_changes", "role changes in place, by outcome (ok, failed: the "
                                    "instance stayed as it was)", ["from_role", "to_role", "outcome"], registry=r)
        self.role_change_seconds = Histogram("pdserve_role_change_seconds", "drain, switch and announce",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self._last_bytes: dict[str, int] = {}

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
        """Set the engine gauges from fresh `stats` calls, labelled by data-parallel rank (a rank that cannot
        answer keeps its values)."""
        by_protocol: dict[str, float] = {}
        for rank, stats in await engine.stats_by_rank():
            if stats is not None:
                self._refresh_rank(str(rank), stats)
                for protocol, n in (stats.pd.transfers_by_protocol if stats.pd is not None else {}).items():
                    by_protocol[protocol] = by_protocol.get(protocol, 0) + n
        for protocol, n in by_protocol.items():
            self.transfers_by_protocol.labels(protocol).set(n)
        if isinstance(engine, DataParallelEngine):
            for r in engine.ranks:
                self.dp_served.labels(str(r.rank)).set(r.served)
                self.dp_restarts.labels(str(r.rank)).set(len(r.restarts))

    def _refresh_rank(self, rank: str, stats: EngineStats) -> None:
        self.running.labels(rank).set(stats.running)
        self.waiting.labels(rank).set(stats.waiting)
        self.kv_usage.labels(rank).set(stats.kv_usage)
        self.free_blocks.labels(rank).set(stats.free_blocks)
        prefix = stats.prefix_cache
        self.prefix_queries.labels(rank).set(prefix.queried_tokens)
        self.prefix_hits.labels(rank).set(prefix.hit_tokens)
        rate = prefix.hit_tokens / prefix.queried_tokens if prefix.queried_tokens else 0.0
        self.prefix_hit_rate.labels(rank).set(rate)
        self.preemptions.labels(rank).set(stats.num_preemptions)
        self.total_blocks.labels(rank).set(stats.num_blocks)
        self.preallocated.labels(rank).set(stats.preallocated)
        if stats.host_tier is not None:
            self._refresh_host_tier(rank, stats.host_tier)
        if (disk := stats.disk_tier) is not None:
            self.disk_blocks.labels(rank).set(disk.blocks)
            self.disk_capacity.labels(rank).set(disk.capacity_blocks)
            self.disk_hits.labels(rank).set(disk.hit_blocks)
            self.disk_misses.labels(rank).set(disk.misses)
            self.disk_load_seconds.labels(rank).set(disk.load_seconds)
        for tier, n in prefix.hit_tokens_by_tier.items():
            self.prefix_hits_by_tier.labels(rank, tier).set(n)
        if (pulls := stats.prefix_pulls) is not None:
            self.pulls.labels(rank).set(pulls.pulls)
            self.pulled_blocks.labels(rank).set(pulls.pulled_blocks)
            self.pulls_failed.labels(rank).set(pulls.failed)
            self.pulls_skipped.labels(rank).set(pulls.skipped)
            self.pull_seconds.labels(rank).set(pulls.seconds)
            self.pull_bandwidth.labels(rank).set(pulls.bandwidth)
        self.prefill_rate.labels(rank).set(stats.prefill_rate)
        if stats.pd is not None:
            self._refresh_pd(rank, stats.pd)
        if stats.spec_decode is not None:
            self._refresh_spec_decode(rank, stats.spec_decode)

    def _refresh_spec_decode(self, rank: str, spec: SpecDecodeCounts) -> None:
        self.spec_drafts.labels(rank).set(spec.num_drafts)
        self.spec_draft_tokens.labels(rank).set(spec.num_draft_tokens)
        self.spec_accepted.labels(rank).set(spec.num_accepted_tokens)
        for pos, n in enumerate(spec.accepted_per_pos):
            self.spec_accepted_per_pos.labels(position=str(pos)).set(n)

    def _refresh_host_tier(self, rank: str, host: HostTierStats) -> None:
        self.host_blocks.labels(rank).set(host.blocks)
        self.host_used.labels(rank).set(host.blocks_used)
        self.host_hits.labels(rank).set(host.hit_blocks)
        self.host_swap_ins.labels(rank).set(host.swap_in_blocks)
        self.host_swap_outs.labels(rank).set(host.swap_out_blocks)
        self.host_swap_in_seconds.labels(rank).set(host.swap_in_seconds)

    def _refresh_pd(self, rank: str, pd: PDStats) -> None:
        self.kv_sent.labels(rank).set(pd.bytes_sent)
        self.kv_received.labels(rank).set(pd.bytes_received)
        self.transfers_ok.labels(rank).set(pd.transfers_ok)
        self.transfers_failed.labels(rank).set(pd.transfers_failed)
        self.queued_for_blocks.labels(rank).set(pd.queued_for_blocks)
        self.refused_control.labels(rank).set(pd.refused_control_messages)
        self.refused_kv.labels(rank).set(pd.refused_connections)
        self.blocks_skipped.labels(rank).set(pd.blocks_skipped)
        if (buffer := pd.buffer) is not None:
            self.buffer_blocks.labels(rank).set(buffer.blocks)
            self.buffer_used.labels(rank).set(buffer.blocks_used)
            self.buffered.labels(rank).set(buffer.buffered_requests)
            self.swap_in_bytes.labels(rank).set(buffer.swap_in_bytes)
            for s in buffer.swap_in_seconds:
                self.swap_in_seconds.observe(s)
            for s in buffer.wait_seconds:
                self.buffer_wait_seconds.observe(s)
        for s in pd.transfer_seconds:
            self.transfer_seconds.observe(s)
        moved = pd.bytes_sent + pd.bytes_received
        if pd.transfer_seconds and sum(pd.transfer_seconds) > 0:
            seconds = sum(pd.transfer_seconds)
            self.transfer_gbps.labels(rank).set((moved - self._last_bytes.get(rank, 0)) / seconds / 1e9)
        self._last_bytes[rank] = moved
