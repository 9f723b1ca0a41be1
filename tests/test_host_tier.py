"""The host prefix tier (--swap-space) as the KV cache manager drives it: blocks saved when freed and
held until the copy is reported, a lookup that runs past the device hits loaded back from host memory
with the right bytes, LRU reuse of host blocks, and a reset that forgets both tiers. The copier is
a pair of numpy arrays standing in for the cache service's two segments. Pure Python, no model."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.host_tier import HostTier
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.sampling import SamplingParams

BS = 4


class ArrayCopier:
    """Device and host memory as arrays; a block's content is one number. Saves complete when told."""

    def __init__(self, device_blocks: int, host_blocks: int) -> None:
        self.device = np.zeros(device_blocks)
        self.host = np.full(host_blocks, -1.0)
        self.pending: list[tuple[int, list[int], list[int]]] = []
        self.loads = 0

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None:
        assert not any(disk_keys), "no disk tier here"
        self.pending.append((save_id, device_blocks, host_blocks))

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self.device[device_blocks] = self.host[host_blocks]
        self.loads += 1

    def complete_saves(self, kv: KVCacheManager) -> None:
        for save_id, device_blocks, host_blocks in self.pending:
            self.host[host_blocks] = self.device[device_blocks]
            kv.saved(save_id, host_blocks)
        self.pending = []


def manager(device_blocks: int, host_blocks: int) -> tuple[KVCacheManager, ArrayCopier]:
    kv = KVCacheManager(device_blocks, BS)
    copier = ArrayCopier(device_blocks, host_blocks)
    kv.add_host_tier(host_blocks, copier)
    return kv, copier


def run(kv: KVCacheManager, copier: ArrayCopier, rid: str, tokens: list[int], lora_name: str | None = None
        ) -> Request:
    """Admit, 'compute' (each computed block's content = its first token), commit, free."""
    request = Request(rid, tokens, SamplingParams(max_tokens=1), lora_name=lora_name)
    cached = kv.find_cached_prefix(request)
    assert kv.allocate(request, request.num_tokens - len(cached) * BS, cached)
    for i in range(len(cached), len(request.blocks)):
        copier.device[request.blocks[i].block_id] = tokens[i * BS]
    request.num_computed_tokens = request.num_tokens
    kv.commit_computed(request)
    request.hits = cached  # type: ignore[attr-defined]
    kv.free(request)
    return request


def prompt(first: int, blocks: int) -> list[int]:
    return [first + i for i in range(blocks * BS)] + [9999]  # full blocks plus one token to compute


def test_freed_blocks_are_held_until_their_save_completes() -> None:
    kv, copier = manager(device_blocks=8, host_blocks=8)
    run(kv, copier, "a", prompt(100, 3))
    assert kv.saves_in_flight == 1 and kv.host.num_used_blocks == 3
    assert kv.pool.num_free_blocks == 8 - 3  # the three full blocks cannot be evicted yet
    copier.complete_saves(kv)
    assert kv.saves_in_flight == 0
    kv.pool.check_all_free()
    assert kv.host.stats.swap_out_blocks == 3
    # freed again (another hit), they are in the host tier already: no second copy
    run(kv, copier, "b", prompt(100, 3))
    assert kv.saves_in_flight == 0 and kv.host.stats.swap_out_blocks == 3


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host_with_its_bytes() -> None:
    kv, copier = manager(device_blocks=4, host_blocks=16)
    a = run(kv, copier, "a", prompt(100, 3))
    copier.complete_saves(kv)
    run(kv, copier, "evictor", prompt(500, 3))  # needs 4 blocks: evicts a's
    copier.complete_saves(kv)
    assert all(kv.pool.lookup(h) is None for h in a.block_hashes)
    copier.device[:] = 0  # nothing of a's KV is left on the device
    again = run(kv, copier, "a2", prompt(100, 3))
    assert len(again.hits) == 3 and copier.loads == 1
    assert [copier.device[b.block_id] for b in again.hits] == [100, 104, 108]
    assert kv.host.stats.hit_blocks == 3 and kv.host.stats.swap_in_blocks == 3
    copier.complete_saves(kv)
    kv.pool.check_all_free()


def test_device_hits_then_host_hits_make_one_prefix() -> None:
    kv, copier = manager(device_blocks=6, host_blocks=16)
    a = prompt(100, 4)
    run(kv, copier, "a", a)
    copier.complete_saves(kv)
    # Evict a's tail blocks only: they were freed first, so they are the oldest.
    run(kv, copier, "evictor", prompt(500, 2) + [1])
    copier.complete_saves(kv)
    assert kv.pool.num_cached_blocks == 3 + 2  # a's first three, the evictor's two
    again = run(kv, copier, "a2", a)
    assert len(again.hits) == 4 and kv.host.stats.hit_blocks == 1  # three on the device, one from the host
    assert [copier.device[b.block_id] for b in again.hits] == [100, 104, 108, 112]


def test_host_blocks_are_reused_least_recently_used_first() -> None:
    tier = HostTier(2)
    a, b, c = b"a", b"b", b"c"
    for h in (a, b):
        tier.saved(h, tier.reserve(h))
    tier.lookup(a)  # a is now more recent than b
    tier.saved(c, tier.reserve(c))
    assert c in tier and a in tier and b not in tier


def test_a_full_host_tier_with_every_copy_in_flight_skips_the_save() -> None:
    kv, copier = manager(device_blocks=8, host_blocks=2)
    run(kv, copier, "a", prompt(100, 3))
    assert kv.host.num_used_blocks == 2 and kv.saves_in_flight == 1
    copier.complete_saves(kv)
    kv.pool.check_all_free()


def test_reset_forgets_both_tiers_and_a_late_save_report_changes_nothing() -> None:
    kv, copier = manager(device_blocks=8, host_blocks=8)
    run(kv, copier, "a", prompt(100, 3))
    kv.reset_prefix_cache()  # e.g. new weights; the save of a's blocks is still in flight
    copier.complete_saves(kv)
    kv.pool.check_all_free()
    assert kv.pool.num_cached_blocks == 0 and kv.host.num_used_blocks == 0
    again = run(kv, copier, "a2", prompt(100, 3))
    assert again.hits == [] and copier.loads == 0


def test_the_host_tier_needs_prefix_caching() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        kv.add_host_tier(4, ArrayCopier(8, 4))
