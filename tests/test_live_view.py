"""The live view's parts without a deployment: the last minute's window, KV use per tier, and a frame of
`pdserve top` with a member that is down (the running deployment is in test_tracing.py)."""

from __future__ import annotations

from rich.console import Console

from pdserve.api.status import kv_by_tier
from pdserve.engine.stats import DiskTierStats, EngineStats, HostTierStats, PrefixCacheStats
from pdserve.top.view import frame
from pdserve.utils.recent import RecentEvents


def test_the_window_forgets_what_is_older_than_a_minute_and_gives_percentiles() -> None:
    w = RecentEvents(window=60)
    for t, ms in ((0, 900.0), (30, 100.0), (40, None), (50, 300.0), (55, 200.0)):
        w.add(ms, now=t)
    assert w.count(now=59) == 5
    assert w.percentiles(now=59) == {"p50": 300.0, "p90": 900.0}
    assert w.count(now=61) == 4  # the one at 0 s is gone
    assert w.percentiles(now=61) == {"p50": 200.0, "p90": 300.0}  # nearest rank of 100, 200, 300
    assert RecentEvents().percentiles() == {"p50": None, "p90": None}


def _stats(**tiers: object) -> EngineStats:
    return EngineStats(num_blocks=100, free_blocks=60, cached_blocks=10, kv_usage=0.3, running=1, waiting=0,
                       preallocated=0, num_preemptions=0, num_steps=1, num_computed_tokens=1,
                       prefix_cache=PrefixCacheStats(0, 0, 0, 0), **tiers)


def test_kv_use_is_per_tier_and_ranks_add_up() -> None:
    host = HostTierStats(blocks=400, blocks_used=100, hit_blocks=0, swap_in_blocks=0, swap_out_blocks=0,
                         swap_in_seconds=0.0)
    disk = DiskTierStats(blocks=50, capacity_blocks=1000, hit_blocks=0, misses=0, load_seconds=0.0)
    tiers = kv_by_tier([_stats(host_tier=host, disk_tier=disk), _stats()])
    assert tiers == {"device": {"used_blocks": 60, "blocks": 200, "usage": 0.3},
                     "host": {"used_blocks": 100, "blocks": 400, "usage": 0.25},
                     "disk": {"used_blocks": 50, "blocks": 1000, "usage": 0.05}}


def test_a_frame_shows_each_member_and_one_that_does_not_answer() -> None:
    minute = {"window_s": 60, "requests": 7, "ttft_ms": {"p50": 412.3, "p90": 980.1},
              "itl_ms": {"p50": None, "p90": None}, "refused": 2}
    router, prefill, decode = "http://127.0.0.1:8000", "http://127.0.0.2:8001", "http://127.0.0.3:8002"  # not contacted
    cluster = {"router": {"url": router, "can_serve": True,
                          "last_minute": {"window_s": 60, "requests": 9, "refused": 2, "failed": 0},
                          "prefill_policy": "cache_aware", "decode_policy": "cache_aware", "pd_policy": "conditional"},
               "members": [
                   {"url": prefill, "role": "prefill", "healthy": True, "draining": False,
                    "in_flight_requests": 2, "restarts": 0,
                    "status": {"role": "prefill", "in_flight": 2, "running": 1, "waiting": 1,
                               "kv": {"device": {"usage": 0.31, "blocks": 2000, "used_blocks": 620}},
                               "last_minute": minute}},
                   {"url": decode, "role": "decode", "healthy": False, "draining": False,
                    "in_flight_requests": 0, "restarts": 1, "status": {"error": "Cannot connect"}}]}
    console = Console(width=220, record=True)
    console.print(frame(cluster))
    lines = console.export_text().splitlines()
    assert "9 requests, 2 refused" in lines[0]
    (row,) = [line for line in lines if prefill in line]
    assert "healthy" in row and "31% of 2000" in row and "412/980" in row
    (row,) = [line for line in lines if decode in line]
    assert "down" in row and "Cannot connect" in row
