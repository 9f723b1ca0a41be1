"""The engine's figures on /metrics: one table row per series, read from the last `stats` answer of each
data-parallel rank at scrape time. A count that only grows is a counter (exported with `_total`), a level is a
gauge, a distribution is a histogram kept engine-side; vLLM's names where a figure means the same.

Adding a figure: a field in its struct (engine/stats.py) and a row here."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pdserve.engine.stats import EngineStats, Histogram

Value = float | Histogram | Mapping[str, float] | None
Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Figure:
    name: str  # a counter's without `_total`
    kind: Kind
    help: str
    read: Callable[[EngineStats], Value]  # None: this rank has no such part (no host tier, not a PD role)
    label: str | None = None  # when `read` gives a mapping: the label its keys go in


def _pd(read: Callable) -> Callable[[EngineStats], Value]:
    return lambda s: None if s.pd is None else read(s.pd)


def _buffer(read: Callable) -> Callable[[EngineStats], Value]:
    return lambda s: None if s.pd is None or s.pd.buffer is None else read(s.pd.buffer)


def _host(read: Callable) -> Callable[[EngineStats], Value]:
    return lambda s: None if s.host_tier is None else read(s.host_tier)


def _disk(read: Callable) -> Callable[[EngineStats], Value]:
    return lambda s: None if s.disk_tier is None else read(s.disk_tier)


def _pulls(read: Callable) -> Callable[[EngineStats], Value]:
    return lambda s: None if s.prefix_pulls is None else read(s.prefix_pulls)


def _spec(read: Callable) -> Callable[[EngineStats], Value]:
    return lambda s: None if s.spec_decode is None else read(s.spec_decode)


C, G, H = "counter", "gauge", "histogram"
FIGURES: tuple[Figure, ...] = (
    Figure("pdserve_num_requests_running", G, "requests in the running batch", lambda s: s.running),
    Figure("pdserve_num_requests_waiting", G, "requests waiting for admission", lambda s: s.waiting),
    Figure("pdserve_kv_cache_usage_ratio", G, "share of KV blocks in use", lambda s: s.kv_usage),
    Figure("pdserve_kv_cache_free_blocks", G, "free KV blocks", lambda s: s.free_blocks),
    Figure("pdserve_kv_cache_total_blocks", G, "KV blocks in the cache", lambda s: s.num_blocks),
    Figure("pdserve_num_preemptions", C, "requests preempted", lambda s: s.num_preemptions),
    Figure("pdserve_prefix_cache_queries", C, "prompt tokens looked up in the prefix cache",
           lambda s: s.prefix_cache.queried_tokens),
    Figure("pdserve_prefix_cache_hits", C, "prompt tokens served from the prefix cache",
           lambda s: s.prefix_cache.hit_tokens),
    Figure("pdserve_prefix_cache_hits_by_tier", C, "prompt tokens served from the prefix cache, by where each block "
           "was: device, host, disk, pulled (from a peer)", lambda s: s.prefix_cache.hit_tokens_by_tier, "tier"),
    Figure("pdserve_prefill_tokens_per_second", G, "prompt tokens per second of the engine's steps that were mostly "
           "prompt (the pull cost rule's)", lambda s: s.prefill_rate),
    # PD disaggregation (prefill instances send, decode instances receive)
    Figure("pdserve_num_requests_preallocated", G, "decode: requests holding blocks while their KV arrives",
           lambda s: s.preallocated),
    Figure("pdserve_kv_transfer_bytes_sent", C, "KV bytes written into decode instances", _pd(lambda p: p.bytes_sent)),
    Figure("pdserve_kv_transfer_bytes_received", C, "KV bytes received from prefill instances",
           _pd(lambda p: p.bytes_received)),
    Figure("pdserve_kv_transfers_ok", C, "KV transfers completed", _pd(lambda p: p.transfers_ok)),
    Figure("pdserve_kv_transfers_failed", C, "KV transfers that failed", _pd(lambda p: p.transfers_failed)),
    Figure("pdserve_kv_transfers_by_protocol", C, "prefill: KV transfers completed, by transport",
           _pd(lambda p: p.transfers_by_protocol), "protocol"),
    Figure("pdserve_kv_transfer_seconds", H, "prefill: first scheduled to last layer written; decode: cache info "
           "sent to prefill done", _pd(lambda p: p.transfer_seconds)),
    Figure("pdserve_num_requests_queued_for_blocks", G, "decode: PD requests waiting for free blocks",
           _pd(lambda p: p.queued_for_blocks)),
    Figure("pdserve_kv_quarantined_blocks", G, "decode: blocks held back after a failed transfer (a late write may "
           "still land)", _pd(lambda p: p.quarantined_blocks)),
    Figure("pdserve_pd_refused_control_messages", C, "control messages refused: forged, replayed or from another "
           "cluster", _pd(lambda p: p.refused_control_messages)),
    Figure("pdserve_kv_refused_connections", C, "KV data connections and prefix-pull messages refused (no or "
           "another --cluster-secret)", _pd(lambda p: p.refused_connections)),
    Figure("pdserve_kv_blocks_skipped", C, "decode: prompt blocks not transferred, found in this instance's prefix "
           "cache", _pd(lambda p: p.blocks_skipped)),
    # a decode instance's --splitwise-cache-buffer-size
    Figure("pdserve_splitwise_buffer_blocks", G, "blocks of the splitwise cache buffer", _buffer(lambda b: b.blocks)),
    Figure("pdserve_splitwise_buffer_blocks_used", G, "buffer blocks holding KV", _buffer(lambda b: b.blocks_used)),
    Figure("pdserve_num_requests_buffered", G, "PD requests whose KV is in the buffer, waiting for (or being copied "
           "to) cache blocks", _buffer(lambda b: b.buffered_requests)),
    Figure("pdserve_kv_swap_in_bytes", C, "KV bytes copied buffer -> cache", _buffer(lambda b: b.swap_in_bytes)),
    Figure("pdserve_kv_swap_in_seconds", H, "one request's copy buffer -> cache", _buffer(lambda b: b.swap_in_seconds)),
    Figure("pdserve_splitwise_buffer_wait_seconds", H, "KV complete in the buffer -> copy into the cache started",
           _buffer(lambda b: b.wait_seconds)),
    # the host prefix tier (--swap-space)
    Figure("pdserve_host_cache_blocks", G, "blocks of the host prefix tier", _host(lambda h: h.blocks)),
    Figure("pdserve_host_cache_blocks_used", G, "host tier blocks holding KV (or being written)",
           _host(lambda h: h.blocks_used)),
    Figure("pdserve_host_cache_hit_blocks", C, "prompt blocks served from the host tier",
           _host(lambda h: h.hit_blocks)),
    Figure("pdserve_host_cache_swap_in_blocks", C, "blocks copied host tier -> cache",
           _host(lambda h: h.swap_in_blocks)),
    Figure("pdserve_host_cache_swap_out_blocks", C, "blocks copied cache -> host tier",
           _host(lambda h: h.swap_out_blocks)),
    Figure("pdserve_host_cache_swap_in_seconds", C, "engine time spent waiting for host tier -> cache copies",
           _host(lambda h: h.swap_in_seconds)),
    # the disk tier (--kv-disk-path)
    Figure("pdserve_disk_cache_blocks", G, "blocks of the disk tier holding KV", _disk(lambda d: d.blocks)),
    Figure("pdserve_disk_cache_capacity_blocks", G, "blocks the disk tier has room for",
           _disk(lambda d: d.capacity_blocks)),
    Figure("pdserve_disk_cache_hit_blocks", C, "prompt blocks served from the disk tier",
           _disk(lambda d: d.hit_blocks)),
    Figure("pdserve_disk_cache_misses", C, "disk tier blocks found gone or damaged: computed",
           _disk(lambda d: d.misses)),
    Figure("pdserve_disk_cache_load_seconds", C, "wall time of disk tier reads (off the step)",
           _disk(lambda d: d.load_seconds)),
    # prefix pulls between instances (--enable-kv-pull)
    Figure("pdserve_kv_pulls", C, "prefix pulls asked of peers", _pulls(lambda p: p.pulls)),
    Figure("pdserve_kv_pulled_blocks", C, "blocks prefix pulls brought", _pulls(lambda p: p.pulled_blocks)),
    Figure("pdserve_kv_pulled_bytes", C, "bytes prefix pulls brought", _pulls(lambda p: p.nbytes)),
    Figure("pdserve_kv_pulls_failed", C, "prefix pulls that brought nothing (holder gone or evicted, timed out): "
           "computed", _pulls(lambda p: p.failed)),
    Figure("pdserve_kv_pulls_skipped", C, "routers' pull hints not followed: computing was cheaper",
           _pulls(lambda p: p.skipped)),
    Figure("pdserve_kv_pull_seconds", C, "wall time of prefix pulls (off the step)", _pulls(lambda p: p.seconds)),
    Figure("pdserve_kv_pull_bandwidth_bytes_per_second", G, "the pull bandwidth the cost rule assumes (measured by "
           "pulls)", _pulls(lambda p: p.bandwidth)),
    # --speculative-config (vLLM's spec_decode names)
    Figure("pdserve_spec_decode_num_drafts", C, "sequence steps that carried proposals", _spec(lambda c: c.num_drafts)),
    Figure("pdserve_spec_decode_num_draft_tokens", C, "tokens proposed", _spec(lambda c: c.num_draft_tokens)),
    Figure("pdserve_spec_decode_num_accepted_tokens", C, "proposed tokens accepted",
           _spec(lambda c: c.num_accepted_tokens)),
    Figure("pdserve_spec_decode_num_accepted_tokens_per_pos", C, "proposals accepted at each position of a proposal",
           _spec(lambda c: {str(i): n for i, n in enumerate(c.accepted_per_pos)}), "position"),
)


class EngineCollector:
    """Yields every family of FIGURES (empty until a rank has answered), one series per data-parallel rank."""

    def __init__(self, figures: tuple[Figure, ...] = FIGURES) -> None:
        self.figures = figures
        self.latest: dict[str, EngineStats] = {}  # dp rank -> its last answer (a busy rank keeps its values)

    def collect(self) -> Iterator[Metric]:
        for figure in self.figures:
            labels = ["dp_rank"] + ([figure.label] if figure.label else [])
            family = _family(figure, labels)
            for rank, stats in sorted(self.latest.items()):
                _add(family, rank, figure.read(stats))
            yield family


def _family(figure: Figure, labels: list[str]) -> Metric:
    if figure.kind == "counter":
        return CounterMetricFamily(figure.name, figure.help, labels=labels)
    if figure.kind == "gauge":
        return GaugeMetricFamily(figure.name, figure.help, labels=labels)
    return HistogramMetricFamily(figure.name, figure.help, labels=labels)


def _add(family: Metric, rank: str, value: Value) -> None:
    if value is None:
        return
    if isinstance(value, Histogram):
        family.add_metric([rank], value.cumulative(), value.total)
    elif isinstance(value, Mapping):
        for key, v in sorted(value.items()):
            family.add_metric([rank, key], v)
    else:
        family.add_metric([rank], value)
