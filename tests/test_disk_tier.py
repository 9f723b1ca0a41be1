"""The disk tier under the host tier, as the engine's KV cache manager runs it (copies simulated with arrays):
blocks gone from the device cache and the host tier are read back from disk instead of recomputed, a file lost
on disk ends the run there (the rest is computed), and a reset forgets the disk's blocks and deletes their files."""

from __future__ import annotations

import numpy as np

from pdserve.config.lora import lora_hash_root
from pdserve.engine.disk_tier import DiskTier
from pdserve.engine.kv_cache_manager import KVCacheManager
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
        self.disk_reads = 0

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = ()) -> None:
        self.pending.append((save_id, device_blocks, host_blocks, list(disk_keys)))

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self.device[device_blocks] = self.host[host_blocks]

    def load_from_disk(self, keys: list[bytes], host_blocks: list[int]) -> list[bool]:
        self.disk_reads += 1
        ok = [key in self.disk for key in keys]
        for key, block, present in zip(keys, host_blocks, ok, strict=True):
            if present:
                self.host[block] = self.disk[key]
        return ok

    def remove_from_disk(self, keys: list[bytes]) -> None:
        for key in keys:
            self.disk.pop(key, None)

    def complete_saves(self, kv: KVCacheManager) -> None:
        for save_id, device_blocks, host_blocks, disk_keys in self.pending:
            self.host[host_blocks] = self.device[device_blocks]
            written = [k for k, b in zip(disk_keys, host_blocks, strict=False) if k]
            for key, block in zip(disk_keys, host_blocks, strict=False):
                if key:
                    self.disk[key] = self.host[block]
            kv.saved(save_id, host_blocks, written)
        self.pending = []


def manager(device_blocks: int, host_blocks: int, disk_blocks: int) -> tuple[KVCacheManager, ArrayCopier]:
    kv = KVCacheManager(device_blocks, BS)
    copier = ArrayCopier(device_blocks, host_blocks)
    kv.add_host_tier(host_blocks, copier)
    kv.add_disk_tier(DiskTier(disk_blocks, []))
    return kv, copier


def run(kv: KVCacheManager, copier: ArrayCopier, tokens: list[int]) -> tuple[int, list[float]]:
    """Admit a request, 'compute' its uncached blocks (content: the token sum), free it; returns (cached blocks,
    the device contents of its full blocks)."""
    req = Request("r", tokens, SamplingParams(max_tokens=1))
    prefix = kv.find_cached_prefix(req)
    assert kv.allocate(req, len(tokens) - len(prefix) * BS, prefix)
    for i, block in enumerate(req.blocks[len(prefix):], start=len(prefix)):
        copier.device[block.block_id] = float(sum(tokens[:(i + 1) * BS]))
    req.num_computed_tokens = len(tokens)
    kv.commit_computed(req)
    contents = [float(copier.device[b.block_id]) for b in req.blocks[:len(tokens) // BS]]
    kv.free(req)
    copier.complete_saves(kv)
    return len(prefix), contents


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
