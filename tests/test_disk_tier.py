"""The disk tier under the host tier, as the engine's KV cache manager runs it (copies simulated with arrays):
blocks gone from the device cache and the host tier are read back from disk instead of recomputed, a file lost
on disk ends the run there (the rest is computed), a block is read only once its write finished, a reset forgets
the disk's blocks and deletes their files (those written meanwhile too), and a clean stop writes what the disk
lacks: the host tier's blocks whose write failed and the device cache's blocks still held by requests."""

from __future__ import annotations

import numpy as np

from pdserve.config.lora import lora_hash_root
from pdserve.engine.disk_tier import DiskTier
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.prefix_loads import LoadResult
from pdserve.engine.request import Request
from pdserve.kv.block_hash import hash_block
from pdserve.sampling import SamplingParams

BS = 4


class ArrayCopier:
    """Device and host memory as arrays, the disk as a dict; a block's content is one number."""

    def __init__(self, device_blocks: int, host_blocks: int) -> None:
        self.device = np.zeros(device_blocks)
        self.host = np.full(host_blocks, -1.0)
        self.disk: dict[bytes, float] = {}
        self.pending: list[tuple[int, list[int], list[int], list[bytes]]] = []
        self.writes: list[tuple[bytes, float]] = []  # queued disk writes: (key, the block's content then)
        self.fail_writes = False  # a full disk
        self.disk_reads = 0
        self.loads: list[tuple[str, list[bytes], list[int]]] = []

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None:
        self.pending.append((save_id, device_blocks, host_blocks, list(disk_keys)))

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self.device[device_blocks] = self.host[host_blocks]

    def start_load_from_disk(self, load_id: str, keys: list[bytes], host_blocks: list[int]) -> None:
        self.disk_reads += 1
        self.loads.append((load_id, keys, host_blocks))

    def loads_done(self) -> list[LoadResult]:
        """The reads started so far, done (as the cache service would, off the engine's step)."""
        out = []
        for load_id, keys, host_blocks in self.loads:
            ok = [key in self.disk for key in keys]
            for key, block, present in zip(keys, host_blocks, ok, strict=True):
                if present:
                    self.host[block] = self.disk[key]
            out.append(LoadResult(load_id, ok))
        self.loads = []
        return out

    def remove_from_disk(self, keys: list[bytes]) -> None:
        for key in keys:
            self.disk.pop(key, None)

    def write_to_disk(self, keys: list[bytes], host_blocks: list[int]) -> None:
        self.writes += [(k, float(self.host[b])) for k, b in zip(keys, host_blocks, strict=False) if k]

    def complete_saves(self, kv: KVCacheManager, writes: bool = True) -> None:
        """The host copies finish, then (with `writes`) the disk writes they queued."""
        for save_id, device_blocks, host_blocks, disk_keys in self.pending:
            self.host[host_blocks] = self.device[device_blocks]
            kv.saved(save_id, host_blocks)
            self.write_to_disk(disk_keys, host_blocks)
        self.pending = []
        if writes:
            self.complete_writes(kv)

    def complete_writes(self, kv: KVCacheManager) -> None:
        if not self.fail_writes:
            self.disk.update(self.writes)
        keys = [k for k, _ in self.writes]
        kv.disk_written([] if self.fail_writes else keys, keys if self.fail_writes else [])
        self.writes = []


def manager(device_blocks: int, host_blocks: int, disk_blocks: int) -> tuple[KVCacheManager, ArrayCopier]:
    kv = KVCacheManager(device_blocks, BS)
    copier = ArrayCopier(device_blocks, host_blocks)
    kv.add_host_tier(host_blocks, copier)
    kv.add_disk_tier(DiskTier(disk_blocks, []))
    return kv, copier


def admit(kv: KVCacheManager, copier: ArrayCopier, tokens: list[int]) -> tuple[Request, int, list[float]]:
    """Admit a request and 'compute' its uncached blocks (content: the token sum); returns it, its cached blocks
    and the device contents of its full blocks."""
    req = Request("r", tokens, SamplingParams(max_tokens=1))
    prefix = kv.find_cached_prefix(req)
    if prefix is None:  # a disk read started: it waits aside until the read is done, then asks again
        assert kv.find_cached_prefix(req) is None and kv.finish_loads() == ["r"]
        prefix = kv.find_cached_prefix(req)
    assert kv.allocate(req, len(tokens) - len(prefix) * BS, prefix)
    for i, block in enumerate(req.blocks[len(prefix):], start=len(prefix)):
        copier.device[block.block_id] = float(sum(tokens[:(i + 1) * BS]))
    req.num_computed_tokens = len(tokens)
    kv.commit_computed(req)
    contents = [float(copier.device[b.block_id]) for b in req.blocks[:len(tokens) // BS]]
    return req, len(prefix), contents


def run(kv: KVCacheManager, copier: ArrayCopier, tokens: list[int], writes: bool = True) -> tuple[int, list[float]]:
    """admit(), then free the request and complete its saves; returns (cached blocks, contents)."""
    req, cached, contents = admit(kv, copier, tokens)
    kv.free(req)
    copier.complete_saves(kv, writes)
    return cached, contents


def others(kv: KVCacheManager, copier: ArrayCopier, n: int = 3) -> None:
    """Other prompts push the earlier ones out of the device cache and the host tier."""
    for seed in range(n):
        run(kv, copier, [100 * (seed + 1) + t for t in range(17)])


def test_a_prefix_gone_from_device_and_host_comes_back_from_disk():
    kv, copier = manager(device_blocks=6, host_blocks=4, disk_blocks=32)
    first = list(range(1, 18))  # 4 full blocks + 1 token
    cached, want = run(kv, copier, first)
    assert cached == 0 and len(copier.disk) == 4  # written through with the host saves
    for seed in range(3):  # other prompts push the first out of the device cache and the host tier
        run(kv, copier, [100 * (seed + 1) + t for t in range(17)])
    cached, got = run(kv, copier, first)
    assert cached == 4 and got == want  # read from disk, equal to what was computed
    assert kv.disk.stats.hit_blocks >= 1 and copier.disk_reads >= 1


def test_a_run_longer_than_the_host_tier_is_read_once_as_far_as_it_fits():
    """One read per request, no more blocks than the host tier holds: a second read would evict the first's."""
    kv, copier = manager(device_blocks=8, host_blocks=4, disk_blocks=32)
    first = list(range(1, 26))  # 6 full blocks + 1 token
    run(kv, copier, first[:13])  # its first 3 blocks reach the disk through the 4 host blocks, then the rest
    _, want = run(kv, copier, first)
    others(kv, copier, n=2)
    assert len(copier.disk) >= 6 and all(h not in kv.host for h in kv.disk.saved_hashes()[:6])
    reads = copier.disk_reads
    cached, got = run(kv, copier, first)
    assert cached == 4 and got == want and copier.disk_reads == reads + 1  # the first 4 read, the rest computed


def test_a_lost_file_ends_the_run_and_the_rest_is_computed():
    kv, copier = manager(device_blocks=6, host_blocks=4, disk_blocks=32)
    first = list(range(1, 18))
    _, want = run(kv, copier, first)
    for seed in range(3):
        run(kv, copier, [100 * (seed + 1) + t for t in range(17)])
    hashes = [hash_block(lora_hash_root(None), first[:BS])]
    for i in range(1, 4):
        hashes.append(hash_block(hashes[-1], first[i * BS:(i + 1) * BS]))
    del copier.disk[hashes[2]]  # the third block of the first prompt
    cached, got = run(kv, copier, first)
    assert cached == 2 and got == want  # two read back, the third lost, the rest computed
    assert kv.disk.stats.misses == 1


def test_a_reset_forgets_the_disk_and_deletes_its_files():
    kv, copier = manager(device_blocks=6, host_blocks=4, disk_blocks=32)
    run(kv, copier, list(range(1, 18)))
    kv.reset_prefix_cache()
    assert len(kv.disk) == 0 and copier.disk == {}
    cached, _ = run(kv, copier, list(range(1, 18)))
    assert cached == 0


def test_the_disk_drops_least_recently_used_blocks_and_their_files():
    kv, copier = manager(device_blocks=6, host_blocks=4, disk_blocks=5)
    for seed in range(3):
        run(kv, copier, [100 * (seed + 1) + t for t in range(17)])
    assert len(kv.disk) == 5 and len(copier.disk) == 5


def test_a_block_is_read_from_disk_only_once_its_write_finished():
    kv, copier = manager(device_blocks=6, host_blocks=4, disk_blocks=32)
    first = list(range(1, 18))
    _, want = run(kv, copier, first, writes=False)
    assert len(copier.writes) == 4 and copier.disk == {}  # queued, not written
    for seed in range(3):
        run(kv, copier, [100 * (seed + 1) + t for t in range(17)], writes=False)
    cached, _ = run(kv, copier, first, writes=False)
    assert cached == 0 and kv.disk.stats.hit_blocks == 0  # not yet whole on disk: computed
    copier.complete_writes(kv)
    others(kv, copier)
    cached, got = run(kv, copier, first)
    assert cached == 4 and got == want


def test_writes_that_finish_after_a_reset_are_deleted():
    kv, copier = manager(device_blocks=6, host_blocks=4, disk_blocks=32)
    run(kv, copier, list(range(1, 18)), writes=False)
    kv.reset_prefix_cache()
    copier.complete_writes(kv)
    assert copier.disk == {} and len(kv.disk) == 0


def test_a_clean_stop_writes_what_the_disk_lacks_from_both_tiers():
    kv, copier = manager(device_blocks=12, host_blocks=4, disk_blocks=32)
    copier.fail_writes = True
    _, want_saved = run(kv, copier, list(range(1, 18)))  # in the host tier; its disk writes failed
    copier.fail_writes = False
    held, _, want_held = admit(kv, copier, list(range(50, 67)))  # computed, still held by its request
    assert len(kv.disk) == 0
    ordered: set[bytes] = set()
    while kv.write_tiers_to_disk(ordered, limit=3) or kv.saves_in_flight or kv.disk_writes_in_flight:
        copier.complete_saves(kv)
        copier.complete_writes(kv)
    assert len(kv.disk) == 8 and sorted(copier.disk.values()) == sorted(want_saved + want_held)
    assert not kv.write_tiers_to_disk(ordered, limit=3)  # nothing is ordered twice
    kv.free(held)
    copier.complete_saves(kv)
