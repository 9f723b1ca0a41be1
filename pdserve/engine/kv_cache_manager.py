"""Which blocks each request holds: prefix-cache lookups, allocation for a step, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import Block, BlockPool, hash_block
from pdserve.engine.request import Request


@dataclass
class PrefixCacheStats:
    requests: int = 0  # requests looked up
    hit_requests: int = 0  # requests with at least one block served from the cache
    queried_tokens: int = 0
    hit_tokens: int = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.hit_requests += num_hit_tokens > 0
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.stats = PrefixCacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return []
        self._hash_full_blocks(request, request.num_tokens - 1)
        hits: list[Block] = []
        for block_hash in request.block_hashes[:(request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[Block] = ()) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens (after any cached prefix).

        All or nothing: False, with nothing changed, when the pool cannot cover it.
        """
        computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = self.blocks_needed(computed + num_new_tokens) - len(request.blocks) - len(cached_prefix)
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)  # free blocks the prefix takes
        if max(needed, 0) > self.pool.num_free_blocks - revived:
            return False
        self.pool.take(cached_prefix)
        request.blocks.extend(cached_prefix)
        if needed > 0:
            request.blocks.extend(self.pool.allocate(needed))
        return True

    def commit_computed(self, request: Request) -> None:
        """Index the request's blocks that became full with computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        self._hash_full_blocks(request, request.num_computed_tokens)
        for i in range(request.num_committed_blocks, full):
            self.pool.cache_full_block(request.blocks[i], request.block_hashes[i])
        request.num_committed_blocks = max(request.num_committed_blocks, full)

    def free(self, request: Request) -> None:
        self.pool.free(reversed(request.blocks))
        request.blocks = []
        request.num_committed_blocks = 0

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        bs = self.block_size
        for i in range(len(request.block_hashes), num_tokens // bs):
            parent = request.block_hashes[i - 1] if i else None
            request.block_hashes.append(hash_block(parent, request.token_ids[i * bs:(i + 1) * bs]))
