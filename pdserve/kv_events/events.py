"""The KV event wire format: vLLM's (`vllm/distributed/kv_events.py`), so vLLM's consumers (Dynamo's KV
router, llm-d's precise prefix-cache scorer, vLLM's example subscriber) read pdserve's events and pdserve's
router reads vLLM's.

A batch is msgpack, sent on a ZMQ PUB socket as three frames: topic, an 8-byte big-endian sequence
number (one per batch, from 0), the payload. Block hashes are the engine's chained SHA-256 block hashes
(engine/block_pool.py), which a router computes the same way from a prompt's tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

DEVICE = "GPU"  # the engine's KV cache (vLLM's medium name, also for a CPU engine's cache in RAM)
HOST = "CPU"  # the host tier (--swap-space): blocks evicted from the device cache, copied back on a hit
DISK = "DISK"  # the disk tier (--kv-disk-path): what the host tier saved, kept across restarts
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

BlockHash = bytes | int  # vLLM sends bytes (SHA-256) or, from older versions, int
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"  # vLLM's KV cache spec kinds


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the prefix cache."""


class BlockStored(KVCacheEvent):
    """Full blocks became readable by a prefix lookup. `token_ids` and `parent_block_hash` are empty for
    blocks whose tokens the publisher does not keep (the host tier, a snapshot), as vLLM's CPU offloading
    sends them."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # (vLLM's; pdserve's hashes have no extra keys)
    # A model with layer groups (config/layer_groups.py) stores each group's blocks under the same hashes: the group,
    # its kind and window say whose they are. None: one group for every layer.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # FULL_ATTENTION or SLIDING_WINDOW
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of every medium is gone (new weights, a restarted engine, a snapshot's start)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(KVEventBatch)
