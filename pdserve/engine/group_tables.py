"""The block tables of layer groups 1.. (config/layer_groups.py) of a request, beside group 0's (`request.blocks`,
which KVCacheManager keeps as for any model).

Group 0 is the full-attention group; the others attend within a sliding window. A sliding group's table has an
entry per block of the sequence like group 0's, but holds a block only from the first one the next query can see:
the entries before are None (0 in the worker's table, never read) and their blocks went back to the pool as the
sequence moved on. Blocks of the same tokens in different groups hold different layers' K/V, so a group's blocks
are cached under the token hash with the group's number appended; a prefix hit needs, in every sliding group, the
blocks of the window before the hit's end (vLLM's rule for hybrid models).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from pdserve.config.layer_groups import LayerGroups, group_key
from pdserve.engine.block_pool import Block, BlockPool
from pdserve.engine.request import Request
from pdserve.engine.stats import LayerGroupUse
from pdserve.kv.block_hash import BlockHash


class GroupTables:
    def __init__(self, groups: LayerGroups, pool: BlockPool, block_size: int,
                 release: Callable[[Iterable[Block]], object] | None = None) -> None:
        """`release`: how blocks a table lets go go back (KVCacheManager.release: saved to the host tier too)."""
        if groups.windows[0] != 0:
            raise ValueError("layer group 0 must be the full-attention group")
        self.groups, self.pool, self.block_size = groups, pool, block_size
        self.release = release or pool.free
        self.others = range(1, groups.num_groups)

    def _live_from(self, group: int, position: int) -> int:
        return self.groups.first_live_block(group, position, self.block_size)

    def cached_run(self, hashes: list[BlockHash], n: int, coming: Collection[BlockHash] = (),
                   elsewhere: Callable[[bytes], bool] | None = None) -> int:
        """The longest prefix of at most `n` blocks (group 0's hits) whose window every sliding group has cached (or
        will have: blocks `coming`, which requests ahead compute first; or has `elsewhere`: a key in a lower tier)."""
        def held(g: int, h: BlockHash) -> bool:
            key = group_key(g, h)
            return h in coming or self.pool.lookup(key) is not None or (elsewhere is not None and elsewhere(key))

        while n > 0 and not all(held(g, h) for g in self.others
                                for h in hashes[self._live_from(g, n * self.block_size):n]):
            n -= 1
        return n

    def window_keys(self, hashes: list[BlockHash], n: int) -> list[bytes]:
        """The sliding groups' keys of the window before block n: what a hit of n blocks takes in those groups."""
        return [group_key(g, h) for g in self.others for h in hashes[self._live_from(g, n * self.block_size):n]]

    def new_blocks(self, request: Request, computed: int, total: int, num_cached: int,
                   hits: list[list[Block]] | None = None) -> int:
        """Blocks the sliding groups must take from the pool for tokens up to `total`, `computed` of them done
        (`num_cached` leading blocks found cached: those are taken, not allocated; `hits`: each group's of them,
        held by the caller, else looked up)."""
        needed = -(-total // self.block_size)
        n = 0
        for g in self.others:
            held = len(request.group_blocks[g - 1]) if request.group_blocks else 0
            first = max(held, num_cached, self._live_from(g, computed))
            n += max(0, needed - first)
            if num_cached and not held:  # cached blocks revived from the free list count against it too
                cached = hits[g - 1] if hits is not None else self.cached_blocks(g, request, computed, num_cached)
                n += sum(1 for b in cached if b.ref_cnt == 0)
        return n

    def cached_blocks(self, group: int, request: Request, computed: int, num_cached: int) -> list[Block]:
        """The group's cached blocks of the first `num_cached` that a query at `computed` can see."""
        hashes = request.block_hashes[self._live_from(group, computed):num_cached]
        return [self.pool.lookup(group_key(group, h)) for h in hashes]

    def allocate(self, request: Request, computed: int, total: int, num_cached: int,
                 hits: list[list[Block]] | None = None) -> None:
        """Give every sliding group blocks up to `total` tokens and free what the query at `computed` cannot see
        (new_blocks() said the pool has room). Call before group 0 allocates: the cached blocks are taken first,
        so that no new block evicts them."""
        if not request.group_blocks:
            request.group_blocks = [[] for _ in self.others]
        for g in self.others:
            table = request.group_blocks[g - 1]
            if num_cached and not table:
                cached = hits[g - 1] if hits is not None else self.cached_blocks(g, request, computed, num_cached)
                self.pool.take(cached)
                table.extend([None] * (num_cached - len(cached)) + cached)
        needed = -(-total // self.block_size)
        for g in self.others:
            table = request.group_blocks[g - 1]
            live = self._live_from(g, computed)
            self._drop(table, live)
            table.extend([None] * max(0, live - len(table)))
            if needed > len(table):
                table.extend(self.pool.allocate(needed - len(table)))

    def _drop(self, table: list[Block | None], live: int) -> None:
        gone = [b for b in table[:live] if b is not None]
        if gone:
            table[:live] = [None] * min(live, len(table))
            self.release(reversed(gone))

    def commit(self, request: Request, first: int, full: int) -> list[tuple[int, int, list[BlockHash]]]:
        """Index the sliding groups' blocks first..full-1 that became full (those still held). The runs newly
        indexed, for KV events: (group, first block, their hashes)."""
        runs: list[tuple[int, int, list[BlockHash]]] = []
        for g in self.others:
            table = request.group_blocks[g - 1] if request.group_blocks else []
            run: list[BlockHash] = []
            for i in range(first, min(full, len(table))):
                block_hash = request.block_hashes[i]
                if table[i] is not None and self.pool.cache_full_block(table[i], group_key(g, block_hash)):
                    if not run:
                        runs.append((g, i, run))
                    run.append(block_hash)
                else:
                    run = []
        return runs

    def trim(self, request: Request, keep: int) -> None:
        """Give back the blocks past the first `keep` of every sliding group."""
        for table in request.group_blocks:
            extra = [b for b in table[keep:] if b is not None]
            del table[keep:]
            self.release(reversed(extra))

    def free(self, request: Request) -> None:
        for table in request.group_blocks:
            self.release(reversed([b for b in table if b is not None]))
        request.group_blocks = []

    def held(self, request: Request) -> list[int]:
        """Blocks each group holds for the request, group 0 first."""
        return [len(request.blocks), *(sum(b is not None for b in t) for t in request.group_blocks)]

    def use(self, requests: Iterable[Request]) -> list[LayerGroupUse]:
        """The blocks each group's tables hold across these requests."""
        held = [0] * self.groups.num_groups
        for request in requests:
            for g, n in enumerate(self.held(request)):
                held[g] += n
        return [LayerGroupUse(len(layers), window, n)
                for layers, window, n in zip(self.groups.layers, self.groups.windows, held, strict=True)]
