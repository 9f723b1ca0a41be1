"""The host prefix tier (`--swap-space GB`): which full KV blocks the cache service keeps in host memory.

The device pool (block_pool.py) evicts its least recently freed cached blocks when it needs room. With
a host tier, a cached block's KV is saved to host memory when it becomes evictable (its last holder
freed it), so by the time the pool evicts it the copy exists; a later prompt whose prefix goes on past
the device cache's hits finds the rest here, and those blocks are copied back instead of recomputed.

Saved when freed, not when evicted: eviction happens while a step is being scheduled, just before the
block is overwritten, and a copy there would make the step wait for the cache service. A block being
saved stays held in the device pool until the copy is reported done, so nothing overwrites it.

This index lives in the engine; the bytes live in the cache service's host segment, copied on the
engine's orders (engine/block_copies.py) by the cache service or, for a cache in device memory, by the worker.
Host blocks are reused least recently used first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from pdserve.engine.stats import HostTierStats
from pdserve.kv.block_hash import BlockHash
from pdserve.kv_events.events import HOST

if TYPE_CHECKING:
    from pdserve.kv_events.recorder import KVEventRecorder


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the host tier needs at least one block")
        self.num_blocks = num_blocks
        self._saved: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._saving: dict[BlockHash, int] = {}  # copies in flight: not readable, not reusable
        self._clean: list[int] = list(range(num_blocks - 1, -1, -1))
        self._quarantined: list[tuple[float, int]] = []  # (usable again at, block): failed pulls' blocks
        self.stats = HostTierStats()
        self.events: KVEventRecorder | None = None  # told of each block saved and each one reused

    @property
    def num_used_blocks(self) -> int:
        return len(self._saved) + len(self._saving)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._saved or block_hash in self._saving

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host block holding this hash's KV (now the most recently used), or None."""
        block = self._saved.get(block_hash)
        if block is not None:
            self._saved.move_to_end(block_hash)
        return block

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A host block to save this hash into: a clean one, else the least recently used saved one.
        None when every block has a copy in flight."""
        self._release_quarantined()
        if self._clean:
            block = self._clean.pop()
        elif self._saved:
            evicted, block = self._saved.popitem(last=False)
            if self.events is not None:
                self.events.removed(evicted, HOST)
        else:
            return None
        self._saving[block_hash] = block
        return block

    def saved(self, block_hash: BlockHash, block: int, from_device: bool = True) -> None:
        """The copy into `block` completed (from the device cache, or read from the disk tier or a peer): the
        hash is readable from now on."""
        if self._saving.get(block_hash) == block:
            del self._saving[block_hash]
            self._saved[block_hash] = block
            self.stats.swap_out_blocks += from_device
            if self.events is not None:
                self.events.stored_key(block_hash, HOST)
        # else: clear() ran while it was in flight; the block went back to the clean list then

    def abandon(self, block_hash: BlockHash, block: int, unused_until: float | None = None) -> None:
        """A reserved block that will not be filled (its disk read or pull failed): back to the clean list, or
        (`unused_until`, monotonic time) kept out of use until then: a late write may still land in it."""
        if self._saving.get(block_hash) == block:
            del self._saving[block_hash]
            if unused_until is None:
                self._clean.append(block)
            else:
                self._quarantined.append((unused_until, block))

    def _release_quarantined(self) -> None:
        now = time.monotonic()
        if self._quarantined and self._quarantined[0][0] <= now:
            self._clean += [b for t, b in self._quarantined if t <= now]
            self._quarantined = [(t, b) for t, b in self._quarantined if t > now]

    def saved_hashes(self) -> list[BlockHash]:
        return list(self._saved)

    def clear(self) -> None:
        """Forget every saved block (the weights changed, so the KV is stale)."""
        self._saved.clear()
        self._saving.clear()
        quarantined = {b for _, b in self._quarantined}
        self._clean = [b for b in range(self.num_blocks - 1, -1, -1) if b not in quarantined]
