"""The disk prefix tier (`--kv-disk-path DIR --kv-disk-size SIZE`): which full KV blocks are on disk.

Under the host tier (host_tier.py): a block saved to host memory is written to disk in the same copy, by the
cache service and off the engine's step, unless the disk has it; so the disk holds every block the host tier
held, and an instance restarted on the same folder (and the same weights, dtype and layout: kv/disk_store.py's
fingerprint) finds them again. A lookup whose run of hits goes past the host tier goes on here: those files are
read into host blocks, then copied into the device cache as host hits are. A file that fails its checksum or
vanished ends the run there; the engine computes the rest.

This index lives in the engine, rebuilt at start from the folder's listing; the files are the cache service's
(kv/disk_store.py). Blocks are dropped least recently used first once the size is reached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from pdserve.engine.stats import DiskTierStats
from pdserve.kv.block_hash import BlockHash
from pdserve.kv_events.events import DISK

if TYPE_CHECKING:
    from pdserve.kv_events.recorder import KVEventRecorder


class DiskTier:
    def __init__(self, capacity_blocks: int, found: list[BlockHash]) -> None:
        if capacity_blocks < 1:
            raise ValueError("the disk tier holds no block of this size: raise --kv-disk-size")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict.fromkeys(found)  # least recently used first
        self._writing: set[BlockHash] = set()  # written with a host save in flight: not readable yet
        self.stats = DiskTierStats()
        self.events: KVEventRecorder | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks or block_hash in self._writing

    def readable(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def reserve(self, block_hash: BlockHash) -> list[BlockHash]:
        """Room for a block about to be written; returns the blocks dropped for it (their files are to go)."""
        self._writing.add(block_hash)
        dropped = []
        while len(self._blocks) + len(self._writing) > self.capacity_blocks and self._blocks:
            old, _ = self._blocks.popitem(last=False)
            dropped.append(old)
        if dropped and self.events is not None:
            for old in dropped:
                self.events.removed(old, DISK)
        return dropped

    def written(self, block_hash: BlockHash, ok: bool) -> bool:
        """Its write finished (whole, or not at all); False when the index no longer wants it (clear() ran
        meanwhile: a whole file is then to go)."""
        if block_hash not in self._writing:
            return False
        self._writing.discard(block_hash)
        if ok:
            self._blocks[block_hash] = None
            if self.events is not None:
                self.events.stored_key(block_hash, DISK)
        return True

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    def used(self, block_hash: BlockHash) -> None:
        self._blocks.move_to_end(block_hash)

    def lost(self, block_hash: BlockHash) -> None:
        """Its file was gone or damaged when read."""
        if block_hash in self._blocks:
            del self._blocks[block_hash]
            self.stats.misses += 1
            if self.events is not None:
                self.events.removed(block_hash, DISK)

    def saved_hashes(self) -> list[BlockHash]:
        return list(self._blocks)

    def clear(self) -> list[BlockHash]:
        """Forget every block; returns them (their files are to go)."""
        gone, self._blocks = list(self._blocks), OrderedDict()
        self._writing.clear()
        return gone
