"""GET /status: one instance as a live view shows it (a router's /cluster gathers them): role, load, queue, KV use
by tier, the last minute's TTFT and ITL and refusals."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.stats import EngineStats
from pdserve.utils.recent import RecentEvents


@dataclass
class RecentRequests:
    """The last minute of an instance's answers (milliseconds) and refusals (429)."""

    ttft_ms: RecentEvents = field(default_factory=RecentEvents)
    itl_ms: RecentEvents = field(default_factory=RecentEvents)  # each request's mean inter-token latency
    refused: RecentEvents = field(default_factory=RecentEvents)

    def finished(self, ttft_s: float | None, itl_s: float | None) -> None:
        self.ttft_ms.add(None if ttft_s is None else ttft_s * 1000)
        self.itl_ms.add(None if itl_s is None else itl_s * 1000)

    def summary(self) -> dict:
        return {"window_s": self.ttft_ms.window, "requests": self.ttft_ms.count(),
                "ttft_ms": self.ttft_ms.percentiles(), "itl_ms": self.itl_ms.percentiles(),
                "refused": self.refused.count()}


def instance_status(role: str, in_flight: int, ranks: list[EngineStats | None], recent: RecentRequests) -> dict:
    """The instance's view (its data-parallel ranks added up; a rank that did not answer is left out)."""
    stats = [s for s in ranks if s is not None]
    return {"role": role, "in_flight": in_flight, "engine_answered": len(stats) == len(ranks),
            "running": sum(s.running for s in stats), "waiting": sum(s.waiting for s in stats),
            "preemptions": sum(s.num_preemptions for s in stats), "kv": kv_by_tier(stats),
            "last_minute": recent.summary()}


def kv_by_tier(stats: list[EngineStats]) -> dict[str, dict]:
    """Blocks used and held per tier: device, host (--swap-space), disk (--kv-disk-path)."""
    tiers: dict[str, dict] = {}

    def add(tier: str, used: int, blocks: int) -> None:
        entry = tiers.setdefault(tier, {"used_blocks": 0, "blocks": 0})
        entry["used_blocks"] += used
        entry["blocks"] += blocks

    for s in stats:
        add("device", round(s.kv_usage * s.num_blocks), s.num_blocks)
        if s.host_tier is not None:
            add("host", s.host_tier.blocks_used, s.host_tier.blocks)
        if s.disk_tier is not None:
            add("disk", s.disk_tier.blocks, s.disk_tier.capacity_blocks)
    for entry in tiers.values():
        entry["usage"] = round(entry["used_blocks"] / entry["blocks"], 4) if entry["blocks"] else 0.0
    groups = [s.layer_groups for s in stats if s.layer_groups is not None]
    if groups:  # a block table per layer group: what each holds (its blocks have `layers` of the block's slots)
        tiers["device"]["by_layer_group"] = [
            {"layers": g[0].layers, "window": g[0].window, "used_blocks": sum(r.used_blocks for r in g)}
            for g in zip(*groups, strict=True)]
    return tiers
