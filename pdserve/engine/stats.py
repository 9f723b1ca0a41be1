"""The engine's counters as one typed message: what `stats` answers a frontend (the API server's /metrics, the
offline `LLM.stats()`), field by field, with no string keys between processes."""

from __future__ import annotations

import msgspec

from pdserve.spec_decode.stats import SpecDecodeCounts


class PrefixCacheStats(msgspec.Struct):
    requests: int  # requests that looked their prompt up
    hit_requests: int  # ... and found at least one block
    queried_tokens: int
    hit_tokens: int
    hit_tokens_by_tier: dict[str, int] = {}  # device, host, disk, pulled: where each hit block came from


class HostTierStats(msgspec.Struct):
    blocks: int
    blocks_used: int
    hit_blocks: int  # blocks a prompt found in the host tier (after the device cache)
    swap_in_blocks: int  # host -> device
    swap_out_blocks: int  # device -> host, completed
    swap_in_seconds: float  # the engine's wall time waiting for loads


class DiskTierStats(msgspec.Struct):
    blocks: int  # blocks on disk (readable)
    capacity_blocks: int
    hit_blocks: int  # blocks a prompt found on disk (after the device cache and the host tier)
    misses: int  # blocks listed whose file was gone or damaged when read: computed instead
    load_seconds: float  # the engine's wall time waiting for disk reads


class PrefixPullStats(msgspec.Struct):
    """--enable-kv-pull: pulls this instance made, and the cost rule's two rates."""

    pulls: int
    pulled_blocks: int
    failed: int  # pulls that brought nothing (holder gone or evicted, timed out, refused): computed instead
    skipped: int  # router hints not followed: computing was cheaper
    seconds: float  # the engine's wall time waiting for pulls
    nbytes: int
    bandwidth: float  # bytes/s the cost rule assumes (measured by pulls once there were some)


class DecodeBufferStats(msgspec.Struct):
    """A decode instance's host buffer (--splitwise-cache-buffer-size); the lists are drained by each call."""

    blocks: int
    blocks_used: int
    buffered_requests: int
    swap_in_bytes: int
    swap_in_seconds: list[float]
    wait_seconds: list[float]


class PDStats(msgspec.Struct):
    """A prefill or decode instance's transfers and control plane; `transfer_seconds` is drained by each call."""

    bytes_sent: int
    bytes_received: int
    transfers_ok: int
    transfers_failed: int
    transfer_seconds: list[float]
    transfers_by_protocol: dict[str, int]  # prefill side: completed transfers per transport
    refused_control_messages: int
    queued_for_blocks: int = 0  # decode side from here on
    quarantined_blocks: int = 0
    refused_connections: int = 0
    blocks_skipped: int = 0
    buffer: DecodeBufferStats | None = None


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
