"""The engine's figures on /metrics as data: histograms kept engine-side, a read that changes nothing, counters
typed counter, one series per data-parallel rank."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.api.engine_metrics import FIGURES
from pdserve.api.metrics import ServerMetrics
from pdserve.engine.stats import (
    DecodeBufferStats,
    DiskTierStats,
    EngineStats,
    Histogram,
    HostTierStats,
    PDStats,
    PrefixCacheStats,
    PrefixPullStats,
    copied,
)
from pdserve.spec_decode.stats import SpecDecodeCounts


def _full_stats(hits: int) -> EngineStats:
    pd = PDStats(bytes_sent=4096, transfers_ok=2, transfers_by_protocol={"ipc": 2}, buffer=DecodeBufferStats())
    pd.transfer_seconds.observe(0.02)
    pd.transfer_seconds.observe(3.0)
    return EngineStats(100, 60, 5, 0.4, 2, 1, 0, 3, 10, 500, PrefixCacheStats(1, 1, 64, hits, {"device": hits}),
                       host_tier=HostTierStats(blocks=8), disk_tier=DiskTierStats(capacity_blocks=9),
                       prefix_pulls=PrefixPullStats(pulls=1), pd=pd,
                       spec_decode=SpecDecodeCounts(1, 4, 2, [1, 1, 0, 0], {}))


def test_a_histogram_counts_each_observation_in_its_bucket_and_merges() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]  # le: at or below the bound
    assert (h.count, h.total) == (4, 7.65)
    both = h.merged(h)
    assert both.cumulative()[-1] == ("+Inf", 8) and h.count == 4


def test_a_copy_is_deep_and_fills_in_gauges() -> None:
    own = HostTierStats(hit_blocks=3)
    sent = copied(own, blocks=10, blocks_used=4)
    own.hit_blocks += 1
    assert (sent.hit_blocks, sent.blocks, sent.blocks_used) == (3, 10, 4)
    pd = PDStats()
    sent_pd = copied(pd)
    pd.transfer_seconds.observe(1.0)
    assert sent_pd.transfer_seconds.count == 0


def test_scrapes_change_nothing_and_every_figure_is_exported_per_rank() -> None:
    metrics = ServerMetrics()
    metrics.engine.latest = {"0": _full_stats(32), "1": _full_stats(16)}
    first = generate_latest(metrics.registry).decode()
    assert generate_latest(metrics.registry).decode() == first
    for figure in FIGURES:
        name = figure.name + ("_total" if figure.kind == "counter" else "")
        assert f"# TYPE {name} {figure.kind}" in first, name
    assert 'pdserve_prefix_cache_hits_total{dp_rank="0"} 32.0' in first
    assert 'pdserve_prefix_cache_hits_total{dp_rank="1"} 16.0' in first
    assert 'pdserve_kv_transfer_seconds_bucket{dp_rank="0",le="0.025"} 1.0' in first
    assert 'pdserve_kv_transfer_seconds_count{dp_rank="0"} 2.0' in first
    assert 'pdserve_kv_transfers_by_protocol_total{dp_rank="1",protocol="ipc"} 2.0' in first
    assert 'pdserve_spec_decode_num_accepted_tokens_per_pos_total{dp_rank="0",position="1"} 1.0' in first


def test_a_rank_without_a_part_has_no_series_of_it() -> None:
    metrics = ServerMetrics()
    metrics.engine.latest = {"0": EngineStats(10, 10, 0, 0.0, 0, 0, 0, 0, 0, 0, PrefixCacheStats())}
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_kv_cache_total_blocks{dp_rank="0"} 10.0' in text
    assert "pdserve_host_cache_blocks{" not in text and "pdserve_kv_transfer_seconds_count{" not in text
