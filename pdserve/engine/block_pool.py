"""KV blocks: reference counts, a free list, and the prefix-cache index of full blocks.

A block is in exactly one of three states:
- in use: ref_cnt > 0 (one reference per request holding it);
- cached: ref_cnt == 0 but it holds a full block whose hash is indexed, so a later request with
  the same prefix can take it back; evicted least-recently-freed first when blocks run out;
- clean: ref_cnt == 0 and nothing indexed.
Clean blocks are reused last-freed-first, so a large pool is only touched (faulted in, on CPU) as
far as the load needs it; a block's record is made when it is first handed out (a small model profiled
into a large memory has millions of blocks, and making them all took seconds and hundreds of MB).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.kv.block_hash import BlockHash
from pdserve.kv_events.events import DEVICE

if TYPE_CHECKING:
    from pdserve.kv_events.recorder import KVEventRecorder

@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class KVBlocksLeaked(Exception):
    """An idle engine's check found blocks still held."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[Block] = []  # block ids 0..len-1 have been handed out at least once
        self._clean: list[int] = []  # a stack of freed clean blocks; past them, those never handed out
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._by_hash: dict[BlockHash, int] = {}
        self.events: KVEventRecorder | None = None  # told of each eviction (kv_cache_manager.py: stores)

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + self._never_used + len(self._evictable)

    @property
    def _never_used(self) -> int:
        return self.num_blocks - len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._clean:
                block = self.blocks[self._clean.pop()]
            elif self._never_used:
                block = Block(len(self.blocks))
                self.blocks.append(block)
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                del self._by_hash[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash, DEVICE)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash) -> Block | None:
        block_id = self._by_hash.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def take(self, blocks: Iterable[Block]) -> None:
        """Add a reference to cached blocks (a prefix hit), taking them off the eviction list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> list[Block]:
        """Drop one reference from each block; returns the cached blocks this made evictable. Pass a
        request's blocks last-first, so its tail blocks (least likely to be shared) are evicted first."""
        evictable = []
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._evictable[block.block_id] = None
                    evictable.append(block)
                else:
                    self._clean.append(block.block_id)
        return evictable

    def cache_full_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Index a block that just became full; a block with the same content already indexed wins.
        Whether this indexed it."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block.block_id
        return True

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._by_hash)

    def reset_prefix_cache(self) -> None:
        """Unindex every block (the KV no longer matches the weights): unreferenced cached blocks
        become clean, blocks in use stay with their holders and will be freed as clean."""
        for block_id in self._by_hash.values():
            self.blocks[block_id].block_hash = None
        self._by_hash.clear()
        self._clean.extend(self._evictable)
        self._evictable.clear()

    def check_all_free(self) -> None:
        """Debug check for an idle engine: every block free, none leaked."""
        leaked = [b.block_id for b in self.blocks if b.ref_cnt != 0]
        if leaked or self.num_free_blocks != self.num_blocks:
            raise KVBlocksLeaked(f"KV blocks leaked: {leaked[:10]} (free {self.num_free_blocks}/{self.num_blocks})")
