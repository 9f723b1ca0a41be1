"""Which blocks each request holds: prefix-cache lookups, allocation for a step, freeing.

With a host tier (host_tier.py) the prefix cache has two levels: blocks freed into the device cache
are saved to host memory as well, and a lookup that runs past the device hits goes on in the host
tier, copying those blocks back into device blocks it indexes as cached. A disk tier (disk_tier.py) is a
third: host saves are written to disk too, and a lookup past the host tier's hits reads the disk's into host
blocks first; prefix pulls (prefix_pull.py) bring a peer's. Those two run off the step (prefix_loads.py): the
lookup answers None and the request waits until finish_loads() names it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdserve.config.layer_groups import LayerGroups, split_group_key
from pdserve.config.lora import lora_hash_root
from pdserve.engine.block_pool import Block, BlockPool
from pdserve.engine.disk_tier import DiskTier
from pdserve.engine.group_tables import GroupTables
from pdserve.engine.host_tier import HostTier
from pdserve.engine.prefix_loads import LoadResult, PrefixLoad
from pdserve.engine.prefix_pull import QUARANTINE_S, PullCost
from pdserve.engine.request import Request
from pdserve.engine.stats import PrefixCacheStats
from pdserve.kv.block_hash import BlockHash, hash_block
from pdserve.kv_events.events import DEVICE, DISK, HOST, KVEvent
from pdserve.kv_events.recorder import KVEventRecorder

if TYPE_CHECKING:
    from pdserve.engine.block_copies import BlockCopies


TIERS = (DEVICE_TIER, HOST_TIER, DISK_TIER, PULLED) = ("device", "host", "disk", "pulled")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 layer_groups: LayerGroups | None = None) -> None:
        """`layer_groups`: a block table per layer group (config/layer_groups.py); `request.blocks` is group 0's."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.groups = GroupTables(layer_groups, self.pool, block_size, self.release) if layer_groups else None
        self.stats = PrefixCacheStats(hit_tokens_by_tier=dict.fromkeys(TIERS, 0))
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.copier: BlockCopies | None = None
        self.pulls: PullCost | None = None  # --enable-kv-pull
        self._saves: dict[int, list[Block]] = {}  # save id -> device blocks held until their copy is done
        self._save_ids = itertools.count()
        self._loads: dict[str, PrefixLoad] = {}  # load id -> a disk read or pull in flight
        self._load_of: dict[str, str] = {}  # request id -> its load's id
        self._load_ids = itertools.count()
        self.events: KVEventRecorder | None = None

    def record_events(self) -> KVEventRecorder:
        """From now on every change to the prefix cache (both tiers) is recorded for KV events."""
        self.events = self.pool.events = KVEventRecorder(self.block_size, self.groups.groups if self.groups else None)
        if self.host is not None:
            self.host.events = self.events
        if self.disk is not None:
            self.disk.events = self.events
        return self.events

    def snapshot(self) -> list[KVEvent]:
        """Every cached block, as BlockStored events (a KV event subscriber that missed too much)."""
        recorder = KVEventRecorder(self.block_size, self.groups.groups if self.groups else None)
        for key in sorted(self.pool.cached_hashes(), key=split_group_key):
            recorder.stored_key(key, DEVICE)
        for medium, tier in ((HOST, self.host), (DISK, self.disk)):
            for key in sorted(tier.saved_hashes() if tier is not None else [], key=split_group_key):
                recorder.stored_key(key, medium)
        return recorder.take()

    def add_host_tier(self, num_blocks: int, copier: BlockCopies) -> None:
        if not self.enable_prefix_caching:
            raise ValueError("the host tier keeps prefix-cache blocks; it needs prefix caching")
        self.host, self.copier = HostTier(num_blocks), copier

    def add_disk_tier(self, disk: DiskTier) -> None:
        if self.host is None:
            raise ValueError("the disk tier writes and reads through the host tier: it needs --swap-space")
        self.disk = disk
        disk.events = self.events

    def add_prefix_pulls(self, cost: PullCost) -> None:
        if self.host is None:
            raise ValueError("prefix pulls land in the host tier: they need --swap-space")
        self.pulls = cost

    def record_hits(self, request: Request, num_tokens: int) -> None:
        """The request was admitted with its cached prefix (num_cached_tokens): count it, by the tier each block
        came from."""
        bs = self.block_size
        by_tier = dict.fromkeys(TIERS, 0)
        for block_hash in request.block_hashes[:request.num_cached_tokens // bs]:
            by_tier[request.prefix_tiers.get(block_hash, DEVICE_TIER)] += bs
        self.stats.record(num_tokens, request.num_cached_tokens, by_tier)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def expected_cached_blocks(self, request: Request, coming: set[BlockHash]) -> int:
        """How many leading full blocks of a waiting request's prompt it will find cached when it is scheduled:
        held on the device or in the host tier now, or in `coming` (blocks that requests ahead of it compute
        first). For the load report; takes and moves nothing (the disk tier, which costs a read, is not
        counted)."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return 0
        self._hash_full_blocks(request, request.num_tokens - 1)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        n = 0
        for block_hash in hashes:
            if not (block_hash in coming or self.pool.lookup(block_hash) is not None
                    or (self.host is not None and block_hash in self.host)):
                break
            n += 1
        if self.groups is None:
            return n
        return self.groups.cached_run(hashes, n, coming, elsewhere=lambda k: self.host is not None and k in self.host)

    def find_cached_prefix(self, request: Request) -> list[Block] | None:
        """The longest run of cached full blocks at the start of the request's tokens; None while blocks of the
        run are being brought into the host tier (from the disk tier, or pulled from a peer): ask again once
        finish_loads() names the request.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need the whole prompt computed (the cached part has no logits)
        if request.request_id in self._load_of:
            return None
        self._hash_full_blocks(request, request.num_tokens - 1)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        hits: list[Block] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.groups is not None:
            return self._group_prefix(request, hashes, hits)
        if self.host is not None and len(hits) < len(hashes):
            rest = hashes[len(hits):]
            if self._start_disk_load(request, rest) or self._start_pull(request, rest, len(hits)):
                return None
            loaded = self._load_from_host(hits, rest)
            for block in loaded:
                request.prefix_tiers.setdefault(block.block_hash, HOST_TIER)  # (a load names its own tier)
            self._record_stored(request, len(hits), [b.block_hash for b in loaded])
            hits += loaded
        return hits

    def _group_prefix(self, request: Request, hashes: list[BlockHash], hits: list[Block]) -> list[Block] | None:
        """find_cached_prefix with layer groups: group 0's run, continued in the host and disk tiers, as far as every
        sliding group has its window's blocks before its end in some tier; what is below the device is brought up
        (the sliding groups' blocks as cached blocks that allocate() takes)."""
        if self.host is None:
            return hits[:self.groups.cached_run(hashes, len(hits))]
        n = len(hits)
        while n < len(hashes) and (self.pool.lookup(hashes[n]) is not None or self._below_device(hashes[n])):
            n += 1
        n = self.groups.cached_run(hashes, n, elsewhere=self._below_device)
        wanted = hashes[len(hits):n] + self.groups.window_keys(hashes, n)
        missing = [k for k in wanted if self.pool.lookup(k) is None]
        if self._start_disk_load(request, missing) or self._start_pull(request, hashes[len(hits):], len(hits),
                                                                       self._pulled_windows(request, hashes, n)):
            return None
        on_device = [b for k in wanted if (b := self.pool.lookup(k)) is not None]
        loaded = {b.block_hash for b in self._load_from_host(hits + on_device, missing)}
        self._record_loaded(request, hashes, len(hits), n, loaded)
        for i in range(len(hits), n):
            if (block := self.pool.lookup(hashes[i])) is None:
                break
            hits.append(block)
        return hits[:self.groups.cached_run(hashes, len(hits))]

    def _record_loaded(self, request: Request, hashes: list[BlockHash], first: int, end: int,
                       loaded: set[bytes]) -> None:
        """Tiers and KV events of the keys just copied up from the host tier: group 0's runs of blocks first..end,
        then the sliding groups' window blocks."""
        runs: list[tuple[int, list[bytes]]] = []
        for i in range(first, end):
            if hashes[i] not in loaded:
                continue
            request.prefix_tiers.setdefault(hashes[i], HOST_TIER)
            if runs and runs[-1][0] + len(runs[-1][1]) == i:
                runs[-1][1].append(hashes[i])
            else:
                runs.append((i, [hashes[i]]))
        for start, run in runs:
            self._record_stored(request, start, run)
        if self.events is not None:
            for key in loaded - set(hashes[first:end]):
                self.events.stored_key(key, DEVICE)

    def _pulled_windows(self, request: Request, hashes: list[BlockHash], n: int) -> list[bytes]:
        """The sliding groups' window keys a pull of the peer's run (past the `n` blocks held here) must bring too."""
        hint = request.kv_pull
        if self.pulls is None or hint is None or hint.num_blocks <= n:
            return []
        keys = self.groups.window_keys(hashes, min(len(hashes), hint.num_blocks))
        return [k for k in keys if self.pool.lookup(k) is None and k not in self.host]

    def _below_device(self, key: bytes) -> bool:
        return key in self.host or (self.disk is not None and self.disk.readable(key))

    # ---- loads into the host tier, off the step (prefix_loads.py) ------------------------------------

    def _start_disk_load(self, request: Request, hashes: list[bytes]) -> bool:
        """Past the device hits: start reading the disk tier's blocks of the run the host tier lacks into host
        blocks, so that the host tier holds the run when the request asks again; once per request, and no more
        than the host tier holds beside the run's blocks already there (a read must not evict its own run). False:
        nothing to read."""
        if self.disk is None or request.disk_read:
            return False
        wanted, in_host = [], 0
        for block_hash in hashes:
            if block_hash in self.host:
                self.host.lookup(block_hash)  # most recently used: the reservations below must not evict it
                in_host += 1
                continue
            if len(wanted) + in_host >= self.host.num_blocks or not self.disk.readable(block_hash):
                break
            wanted.append(block_hash)
        keys, host_blocks = self._reserve_host(wanted)
        if not keys:
            return False
        request.disk_read = True
        load = self._begin(request, DISK_TIER, keys, host_blocks)
        self.copier.start_load_from_disk(load.load_id, keys, host_blocks)
        return True

    def _start_pull(self, request: Request, hashes: list[bytes], num_hits: int, windows: list[bytes] = ()) -> bool:
        """Past the local hits: start pulling the rest of the run the peer holds into host blocks (and with layer
        groups the sliding groups' `windows` after it), when that is cheaper than computing it (one pull per
        request). False: no pull."""
        hint = request.kv_pull
        if self.pulls is None or hint is None:
            return False
        request.kv_pull = None
        local = 0
        for block_hash in hashes:
            if self.host.lookup(block_hash) is None:  # (most recently used: the reservations below keep it)
                break
            local += 1
        wanted = hashes[local:max(local, min(len(hashes), hint.num_blocks - num_hits))] + list(windows)
        if not wanted:
            return False
        if not self.pulls.pays(len(wanted)):
            self.pulls.stats.skipped += 1
            return False
        keys, host_blocks = self._reserve_host(wanted)
        if not keys:
            return False
        deadline = self.pulls.deadline(len(keys))
        load = self._begin(request, PULLED, keys, host_blocks, answer_by=deadline + 1.0)
        self.copier.start_pull(load.load_id, hint.addr, keys, host_blocks, deadline)
        return True

    def _reserve_host(self, hashes: list[bytes]) -> tuple[list[bytes], list[int]]:
        """Host blocks for the leading hashes, as many as the host tier can reserve: (those hashes, their blocks)."""
        keys, host_blocks = [], []
        for block_hash in hashes:
            if (host_block := self.host.reserve(block_hash)) is None:
                break
            keys.append(block_hash)
            host_blocks.append(host_block)
        return keys, host_blocks

    def _begin(self, request: Request, source: str, keys: list[bytes], host_blocks: list[int],
               answer_by: float = float("inf")) -> PrefixLoad:
        load = PrefixLoad(f"{request.request_id}#{next(self._load_ids)}", request, source, keys, host_blocks,
                          time.perf_counter(), answer_by)
        self._loads[load.load_id] = load
        self._load_of[request.request_id] = load.load_id
        return load

    def finish_loads(self) -> list[str]:
        """Apply the loads that completed, failed or ran past their time since the last call; the ids of their
        requests (which may have been aborted meanwhile)."""
        if self.copier is None:
            return []
        # asked every turn of the engine's loop, loads or not: this drains the cache service's socket, which the
        # engine polls (a message left there would wake it at once, again and again)
        results = self.copier.loads_done()
        if not self._loads:
            return []
        done = [(self._loads.pop(r.load_id), r) for r in results if r.load_id in self._loads]
        now = time.time()
        done += [(self._loads.pop(i), None) for i, load in list(self._loads.items()) if now > load.answer_by]
        for load, result in done:
            del self._load_of[load.request.request_id]
            if load.source == DISK_TIER:
                self._finish_disk_load(load, result)
            else:
                self._finish_pull(load, result)
        return [load.request.request_id for load, _ in done]

    @property
    def next_load_deadline(self) -> float | None:
        """When the engine must look again even if no answer comes (unix time), or None."""
        return min((load.answer_by for load in self._loads.values()), default=None)

    def _finish_disk_load(self, load: PrefixLoad, result: LoadResult | None) -> None:
        self.disk.stats.load_seconds += time.perf_counter() - load.started
        ok = result.ok if result is not None else [False] * len(load.keys)
        intact = not load.cancelled
        for block_hash, host_block, read in zip(load.keys, load.host_blocks, ok, strict=True):
            intact = intact and read
            if intact:
                self.host.saved(block_hash, host_block, from_device=False)
                self.disk.used(block_hash)
                self.disk.stats.hit_blocks += 1
                load.request.prefix_tiers[block_hash] = DISK_TIER
            else:
                self.host.abandon(block_hash, host_block)
                if not read and not load.cancelled:
                    self.disk.lost(block_hash)

    def _finish_pull(self, load: PrefixLoad, result: LoadResult | None) -> None:
        n = 0 if result is None or load.cancelled else sum(1 for _ in itertools.takewhile(bool, result.ok))
        # the holder's own write time when it answered: the engine may notice the answer a long step later
        if result is not None and result.seconds > 0:
            self.pulls.measured(result.nbytes, result.seconds, round_trip=False)
        else:
            self.pulls.measured(result.nbytes if result is not None else 0, time.perf_counter() - load.started)
        stats = self.pulls.stats
        stats.pulls += 1
        stats.pulled_blocks += n
        stats.failed += n == 0
        for i, (block_hash, host_block) in enumerate(zip(load.keys, load.host_blocks, strict=True)):
            if i < n:
                self.host.saved(block_hash, host_block, from_device=False)
                load.request.prefix_tiers[block_hash] = PULLED
            else:  # not written; with no answer, a late write may still land: the block waits
                until = None if result is not None else time.monotonic() + QUARANTINE_S
                self.host.abandon(block_hash, host_block, until)
        if self.disk is not None and n:  # the disk holds what the host tier holds
            self.copier.write_to_disk([self._disk_key(h) for h in load.keys[:n]], load.host_blocks[:n])

    def _load_from_host(self, hits: list[Block], hashes: list[bytes]) -> list[Block]:
        """Copy the host tier's run of these hashes into free device blocks, indexed as cached (not
        held: the caller takes them, as it takes device hits). As many as the pool has room for."""
        host_blocks = []
        for block_hash in hashes:
            if (host_block := self.host.lookup(block_hash)) is None:
                break
            host_blocks.append(host_block)
        self.pool.take(hits)  # so that making room below does not evict the device hits
        try:
            n = min(len(host_blocks), self.pool.num_free_blocks)
            if n == 0:
                return []
            blocks = self.pool.allocate(n)
            start = time.perf_counter()
            self.copier.load_blocks(host_blocks[:n], [b.block_id for b in blocks])
            self.host.stats.swap_in_seconds += time.perf_counter() - start
            self.host.stats.hit_blocks += n
            self.host.stats.swap_in_blocks += n
            for block, block_hash in zip(blocks, hashes, strict=False):
                self.pool.cache_full_block(block, block_hash)
            self.pool.free(reversed(blocks))  # now cached and evictable, like any device hit
            return blocks
        finally:
            self.pool.free(reversed(hits))

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[Block] = (),
                 query_from: int | None = None, window_hits: list[list[Block]] | None = None) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens (after any cached prefix). `query_from`: where the
        first query that reads them sits (default: the first new token); a sliding-window group holds no block
        before its window from there (a decode instance's prompt, filled from outside: its first decode step).
        `window_hits`: the sliding groups' cached blocks of the prefix (window_hits()), held by the caller since it
        found them; else looked up now.

        All or nothing: False, with nothing changed, when the pool cannot cover it.
        """
        if not self.can_allocate(request, num_new_tokens, cached_prefix, query_from, window_hits):
            return False
        computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = self.blocks_needed(computed + num_new_tokens) - len(request.blocks) - len(cached_prefix)
        self.pool.take(cached_prefix)
        request.blocks.extend(cached_prefix)
        if self.groups is not None:
            self.groups.allocate(request, computed if query_from is None else query_from, computed + num_new_tokens,
                                 len(cached_prefix), window_hits or None)
        if needed > 0:
            request.blocks.extend(self.pool.allocate(needed))
        return True

    def can_allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[Block] = (),
                     query_from: int | None = None, window_hits: list[list[Block]] | None = None) -> bool:
        """allocate() would succeed now (nothing is taken)."""
        computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        total = computed + num_new_tokens
        needed = self.blocks_needed(total) - len(request.blocks) - len(cached_prefix)
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)  # free blocks the prefix takes
        if self.groups is not None:
            revived += self.groups.new_blocks(request, computed if query_from is None else query_from, total,
                                              len(cached_prefix), window_hits or None)
        return max(needed, 0) <= self.pool.num_free_blocks - revived

    def window_hits(self, request: Request, num_cached: int, query_from: int) -> list[list[Block]]:
        """Each sliding-window group's cached blocks of the first `num_cached` blocks that a query at `query_from`
        can see (those allocate() would take); none without layer groups."""
        if self.groups is None:
            return []
        return [self.groups.cached_blocks(g, request, query_from, num_cached) for g in self.groups.others]

    def commit_computed(self, request: Request) -> None:
        """Index the request's blocks that became full with computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        self._hash_full_blocks(request, request.num_computed_tokens)
        start, run = request.num_committed_blocks, []  # a run of newly indexed blocks is one event
        for i in range(request.num_committed_blocks, full):
            if self.pool.cache_full_block(request.blocks[i], request.block_hashes[i]):
                start = start if run else i
                run.append(request.block_hashes[i])
            elif run:  # its content was cached already, in another block
                self._record_stored(request, start, run)
                run = []
        self._record_stored(request, start, run)
        if self.groups is not None:
            for group, first, hashes in self.groups.commit(request, request.num_committed_blocks, full):
                self._record_stored(request, first, hashes, group)
        request.num_committed_blocks = max(request.num_committed_blocks, full)

    def _record_stored(self, request: Request, first: int, hashes: list[bytes], group: int = 0) -> None:
        """Blocks first.. of the request (their hashes) were indexed in the device cache (in this layer group)."""
        if self.events is None or not hashes:
            return
        bs = self.block_size
        parent = request.block_hashes[first - 1] if first else None
        self.events.stored(hashes, parent, request.token_ids[first * bs:(first + len(hashes)) * bs], DEVICE,
                           request.lora_name, group)

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's tokens (those taken for rejected proposals; never
        indexed in the prefix cache: only blocks full of computed tokens are)."""
        keep = self.blocks_needed(request.num_tokens)
        if len(request.blocks) > keep:
            extra, request.blocks = request.blocks[keep:], request.blocks[:keep]
            self.release(reversed(extra))
        if self.groups is not None:
            self.groups.trim(request, keep)

    def free(self, request: Request) -> None:
        self.release(reversed(request.blocks))
        request.blocks = []
        if self.groups is not None:
            self.groups.free(request)
        request.num_committed_blocks = 0

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block (pass a request's blocks last-first)."""
        evictable = self.pool.free(blocks)
        if self.host is not None and evictable:
            self._save_to_host(evictable)

    def _save_to_host(self, blocks: list[Block]) -> None:
        """Cached blocks just became evictable: copy those the host tier lacks there, holding them
        in the device pool until the copy is done (saved())."""
        to_save, host_blocks, disk_keys = [], [], []
        for block in blocks:
            if block.block_hash in self.host:
                self.host.lookup(block.block_hash)  # used again: keep it longer
                continue
            if (host_block := self.host.reserve(block.block_hash)) is None:
                break  # every host block has a copy in flight
            to_save.append(block)
            host_blocks.append(host_block)
            disk_keys.append(self._disk_key(block.block_hash))
        if to_save:
            self.pool.take(to_save)
            save_id = next(self._save_ids)
            self._saves[save_id] = to_save
            self.copier.save_blocks(save_id, [b.block_id for b in to_save], host_blocks, disk_keys,
                                    [b.block_hash for b in to_save] if self.pulls is not None else [])

    def _disk_key(self, block_hash: bytes) -> bytes:
        """The key to write this block to disk under (b"": the disk has it, or there is no disk tier)."""
        if self.disk is None:
            return b""
        if block_hash in self.disk:  # written, or being written
            if self.disk.readable(block_hash):
                self.disk.used(block_hash)
            return b""
        if dropped := self.disk.reserve(block_hash):
            self.copier.remove_from_disk(dropped)
        return block_hash

    def saved(self, save_id: int, host_blocks: list[int]) -> None:
        """The copier finished save `save_id` (into these host blocks): the device blocks go back."""
        blocks = self._saves.pop(save_id)
        for block, host_block in zip(blocks, host_blocks, strict=True):
            self.host.saved(block.block_hash, host_block)
        self.pool.free(blocks)  # in the order they were freed first: the tail of a prompt is evicted first

    def disk_written(self, written: list[bytes], failed: list[bytes]) -> None:
        """The cache service finished these disk writes: readable from the disk tier now (or not written)."""
        orphans = [key for key in written if not self.disk.written(key, True)]
        for key in failed:
            self.disk.written(key, False)
        if orphans:  # the index forgot them while they were written (a reset): their files go too
            self.copier.remove_from_disk(orphans)

    def write_tiers_to_disk(self, ordered: set[bytes], limit: int) -> bool:
        """A clean stop: order the writes of up to `limit` prefix blocks the disk lacks (not in `ordered`, which
        gains them): the host tier's, then the device cache's through the host tier, as many as it has room for
        (call again once writes and saves complete). False when there was nothing left to order."""
        if self.disk is None:
            return False
        keys, host_blocks = [], []
        for block_hash in self.host.saved_hashes():
            if len(keys) < limit and block_hash not in self.disk and block_hash not in ordered:
                keys.append(self._disk_key(block_hash))
                host_blocks.append(self.host.lookup(block_hash))
        if keys:
            self.copier.write_to_disk(keys, host_blocks)
        device = [b for h in self.pool.cached_hashes()
                  if h not in self.host and h not in ordered and (b := self.pool.lookup(h)) is not None]
        saves = set(self._saves)
        self._save_to_host(device[:max(0, limit - len(keys))])
        new = [b.block_hash for i in set(self._saves) - saves for b in self._saves[i]]
        ordered.update(keys, new)
        return bool(keys or new)

    @property
    def disk_writes_in_flight(self) -> int:
        return self.disk.num_writing if self.disk is not None else 0

    @property
    def saves_in_flight(self) -> int:
        return len(self._saves)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, in both tiers (copies in flight still hold their device blocks
        until reported)."""
        self.pool.reset_prefix_cache()
        if self.host is not None:
            for load in self._loads.values():  # their host blocks stay out of use: a late write may land
                load.cancelled = True
                for block_hash, host_block in zip(load.keys, load.host_blocks, strict=True):
                    self.host.abandon(block_hash, host_block, time.monotonic() + QUARANTINE_S)
            self.host.clear()
            if self.pulls is not None:
                self.copier.forget_host_blocks()
        if self.disk is not None and (gone := self.disk.clear()):
            self.copier.remove_from_disk(gone)
        if self.events is not None:
            self.events.cleared()

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        bs = self.block_size
        for i in range(len(request.block_hashes), num_tokens // bs):
            parent = request.block_hashes[i - 1] if i else lora_hash_root(request.lora_name)
            request.block_hashes.append(hash_block(parent, request.token_ids[i * bs:(i + 1) * bs]))
