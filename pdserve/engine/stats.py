"""The engine's figures as typed messages: what `stats` answers a frontend (the API server's /metrics and /status,
the offline `LLM.stats()`), field by field, with no string keys between processes.

Each component keeps its own struct from here and adds to it in place; `stats` copies them. Counts and
histograms only grow: reading them changes nothing, so any number of readers (a scrape, /status, a role change)
see every observation. A gauge (blocks in use, requests waiting) is filled in when the message is built.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TypeVar

import msgspec

from pdserve.spec_decode.stats import SpecDecodeCounts

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
COPY_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30)


class Histogram(msgspec.Struct):
    """Observations counted per bucket (`counts[i]`: values <= bounds[i] and above the bucket before; the last is
    +Inf), as Prometheus keeps them engine-side, so that the samples never travel or get drained."""

    bounds: tuple[float, ...]
    counts: list[int] = []
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus's buckets: (upper bound, observations at or below it), +Inf last."""
        out, running = [], 0
        for bound, n in zip((*map(str, map(float, self.bounds)), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def merged(self, other: Histogram) -> Histogram:
        return Histogram(self.bounds, [a + b for a, b in zip(self.counts, other.counts, strict=True)],
                         self.total + other.total)


def latency_histogram() -> Histogram:
    return Histogram(LATENCY_BUCKETS)


class PrefixCacheStats(msgspec.Struct):
    requests: int = 0  # requests that looked their prompt up
    hit_requests: int = 0  # ... and found at least one block
    queried_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = {}  # device, host, disk, pulled: where each hit block came from

    def record(self, num_tokens: int, num_hit_tokens: int, by_tier: dict[str, int] | None = None) -> None:
        """One lookup; `by_tier` splits the hits by where they were (all on the device when not given)."""
        self.requests += 1
        self.hit_requests += num_hit_tokens > 0
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens
        for tier, n in (by_tier or {"device": num_hit_tokens}).items():
            self.hit_tokens_by_tier[tier] = self.hit_tokens_by_tier.get(tier, 0) + n

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class HostTierStats(msgspec.Struct):
    blocks: int = 0  # gauge
    blocks_used: int = 0  # gauge
    hit_blocks: int = 0  # blocks a prompt found in the host tier (after the device cache)
    swap_in_blocks: int = 0  # host -> device
    swap_out_blocks: int = 0  # device -> host, completed
    swap_in_seconds: float = 0.0  # the engine's wall time waiting for loads


class DiskTierStats(msgspec.Struct):
    blocks: int = 0  # gauge: blocks on disk (readable)
    capacity_blocks: int = 0
    hit_blocks: int = 0  # blocks a prompt found on disk (after the device cache and the host tier)
    misses: int = 0  # blocks listed whose file was gone or damaged when read: computed instead
    load_seconds: float = 0.0  # the wall time of disk reads (off the step)


class PrefixPullStats(msgspec.Struct):
    """--enable-kv-pull: pulls this instance made, and the cost rule's two rates."""

    pulls: int = 0
    pulled_blocks: int = 0
    failed: int = 0  # pulls that brought nothing (holder gone or evicted, timed out, refused): computed instead
    skipped: int = 0  # router hints not followed: computing was cheaper
    seconds: float = 0.0  # the wall time of pulls (off the step)
    nbytes: int = 0
    bandwidth: float = 0.0  # gauge: bytes/s the cost rule assumes (measured by pulls once there were some)


class DecodeBufferStats(msgspec.Struct):
    """A decode instance's host buffer (--splitwise-cache-buffer-size)."""

    blocks: int = 0  # gauge
    blocks_used: int = 0  # gauge
    buffered_requests: int = 0  # gauge
    swap_in_bytes: int = 0
    swap_in_seconds: Histogram = msgspec.field(default_factory=lambda: Histogram(COPY_BUCKETS))
    wait_seconds: Histogram = msgspec.field(default_factory=lambda: Histogram(WAIT_BUCKETS))


class PDStats(msgspec.Struct):
    """A prefill or decode instance's transfers and control plane."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    transfer_seconds: Histogram = msgspec.field(default_factory=latency_histogram)
    transfers_by_protocol: dict[str, int] = {}  # prefill side: completed transfers per transport
    refused_control_messages: int = 0
    queued_for_blocks: int = 0  # gauge, decode side from here on
    quarantined_blocks: int = 0  # gauge
    refused_connections: int = 0
    blocks_skipped: int = 0
    buffer: DecodeBufferStats | None = None

    def merged(self, other: PDStats) -> PDStats:
        """Both sides' figures as one instance's (each side counts only its own transfers)."""
        by_protocol = dict(self.transfers_by_protocol)
        for protocol, n in other.transfers_by_protocol.items():
            by_protocol[protocol] = by_protocol.get(protocol, 0) + n
        return PDStats(
            self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received,
            self.transfers_ok + other.transfers_ok, self.transfers_failed + other.transfers_failed,
            self.transfer_seconds.merged(other.transfer_seconds), by_protocol,
            self.refused_control_messages + other.refused_control_messages,
            self.queued_for_blocks + other.queued_for_blocks, self.quarantined_blocks + other.quarantined_blocks,
            self.refused_connections + other.refused_connections, self.blocks_skipped + other.blocks_skipped,
            self.buffer or other.buffer)


class LayerGroupUse(msgspec.Struct):
    """One layer group's blocks (config/layer_groups.py): what its block tables hold now."""

    layers: int
    window: int  # 0: full attention
    used_blocks: int


class EngineStats(msgspec.Struct):
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    kv_usage: float
    running: int
    waiting: int
    preallocated: int
    num_preemptions: int
    num_steps: int
    num_computed_tokens: int
    prefix_cache: PrefixCacheStats
    weights_loaded: bool = True
    host_tier: HostTierStats | None = None  # with --swap-space
    disk_tier: DiskTierStats | None = None  # with --kv-disk-path
    prefix_pulls: PrefixPullStats | None = None  # with --enable-kv-pull
    prefill_rate: float = 0.0  # prompt tokens per second of steps that were mostly prompt (0: none yet)
    spec_decode: SpecDecodeCounts | None = None  # with --speculative-config
    pd: PDStats | None = None  # prefill and decode roles
    layer_groups: list[LayerGroupUse] | None = None  # with a block table per layer group


S = TypeVar("S", bound=msgspec.Struct)


def copied(struct: S, **gauges: object) -> S:
    """A deep copy to send (a component goes on adding to its own), with the gauges filled in."""
    copy = msgspec.msgpack.decode(msgspec.msgpack.encode(struct), type=type(struct))
    return msgspec.structs.replace(copy, **gauges)
