"""BlockPool (ref counts, clean stack, LRU of cached blocks, hash index) and KVCacheManager
(prefix lookup, all-or-nothing allocation, commit, free). Pure Python, no model."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool, KVBlocksLeaked
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.stats import PrefixCacheStats
from pdserve.kv.block_hash import hash_block
from pdserve.sampling import SamplingParams

# ---- BlockPool ---------------------------------------------------------------------------------


def cached_pool(num_blocks: int, num_cached: int) -> tuple[BlockPool, list, list[int]]:
    """A pool whose first `num_cached` blocks were filled, indexed and freed (cached, unreferenced)."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_cached)
    hashes = [hash_block(None, [1000 + i]) for i in range(num_cached)]
    for block, h in zip(blocks, hashes, strict=True):
        pool.cache_full_block(block, h)
    pool.free(blocks)
    return pool, blocks, hashes


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_and_free_counts() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8 and pool.usage() == 0.0
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert len({blk.block_id for blk in a + b}) == 8  # all distinct
    assert all(blk.ref_cnt == 1 for blk in a + b)
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free_blocks == 3
    assert pool.allocate(0) == []
    pool.free(b)
    assert pool.num_free_blocks == 8
    pool.check_all_free()


def test_allocate_too_many_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_shared_block_ref_counting() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_full_block(block, h)
    pool.take([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 3  # still held by the other request
    # a block in use is not handed out again, even when all free blocks are taken
    others = pool.allocate(3)
    assert block.block_id not in {b.block_id for b in others}
    pool.free(others)
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4
    assert pool.lookup(h) is block
    pool.check_all_free()


def test_freeing_more_than_taken_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often than taken"):
        pool.free(blocks)
    assert pool.num_free_blocks == 2


def test_cached_block_survives_free_until_evicted() -> None:
    pool, (cached,), (h,) = cached_pool(3, 1)
    assert cached.ref_cnt == 0
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 1
    assert pool.lookup(h) is cached
    # two clean blocks are used first; the cached one survives
    pool.allocate(2)
    assert pool.lookup(h) is cached and cached.block_hash == h
    # the third allocation must evict it
    (reused,) = pool.allocate(1)
    assert reused is cached
    assert pool.lookup(h) is None
    assert reused.block_hash is None and reused.ref_cnt == 1
    assert pool.num_cached_blocks == 0


def test_lookup_of_unknown_hash() -> None:
    pool = BlockPool(2)
    assert pool.lookup(hash_block(None, [1])) is None


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    b0, b1, b2 = pool.allocate(3)
    hashes = {}
    for b in (b0, b1, b2):
        hashes[b.block_id] = hash_block(None, [b.block_id])
        pool.cache_full_block(b, hashes[b.block_id])
    pool.free([b1])
    pool.free([b2])
    pool.free([b0])
    # taking b1 back and freeing it again makes it the most recently freed
    pool.take([b1])
    assert pool.num_free_blocks == 2
    pool.free([b1])
    order = [pool.allocate(1)[0] for _ in range(3)]
    assert [b.block_id for b in order] == [b2.block_id, b0.block_id, b1.block_id]
    assert all(pool.lookup(h) is None for h in hashes.values())


def test_eviction_keeps_the_rest_indexed() -> None:
    pool, blocks, hashes = cached_pool(3, 3)
    # freed together in order 0, 1, 2: block 0 is the oldest
    (evicted,) = pool.allocate(1)
    assert evicted is blocks[0]
    assert pool.lookup(hashes[0]) is None
    assert pool.lookup(hashes[1]) is blocks[1]
    assert pool.lookup(hashes[2]) is blocks[2]


def test_clean_blocks_reused_before_cached_ones_are_evicted() -> None:
    pool, cached, hashes = cached_pool(6, 2)
    fresh = pool.allocate(4)
    assert not {b.block_id for b in fresh} & {b.block_id for b in cached}
    assert [pool.lookup(h) for h in hashes] == cached
    pool.free(fresh)
    # freed clean blocks are reused last-freed-first, still before any cached block
    again = pool.allocate(4)
    assert {b.block_id for b in again} == {b.block_id for b in fresh}
    assert [pool.lookup(h) for h in hashes] == cached


def test_clean_blocks_reused_last_freed_first() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.block_id, b.block_id) == (0, 1)
    pool.free([a])
    pool.free([b])
    assert pool.allocate(1)[0] is b


def test_same_content_already_indexed_wins() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    h = hash_block(None, [5, 6])
    pool.cache_full_block(first, h)
    pool.cache_full_block(second, h)
    assert pool.lookup(h) is first
    assert second.block_hash is None
    pool.free([first, second])
    assert pool.num_cached_blocks == 1


def test_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.allocate(1)
    h = hash_block(None, [1])
    pool.cache_full_block(blocks[0], h)
    pool.free(blocks)
    assert pool.lookup(h) is None and pool.num_cached_blocks == 0


def test_reset_prefix_cache() -> None:
    pool, cached, hashes = cached_pool(4, 3)
    assert pool.num_cached_blocks == 3
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert all(pool.lookup(h) is None for h in hashes)
    assert all(b.block_hash is None for b in cached)
    assert pool.num_free_blocks == 4
    # after the reset they are plain clean blocks: all four can be handed out and returned
    blocks = pool.allocate(4)
    pool.free(blocks)
    pool.check_all_free()


def test_check_all_free_detects_a_leak() -> None:
    pool = BlockPool(4)
    pool.check_all_free()
    blocks = pool.allocate(2)
    with pytest.raises(KVBlocksLeaked, match="leaked"):
        pool.check_all_free()
    pool.free(blocks[:1])
    with pytest.raises(KVBlocksLeaked, match=str(blocks[1].block_id)):
        pool.check_all_free()
    pool.free(blocks[1:])
    pool.check_all_free()


def test_hash_is_chained() -> None:
    a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == a
    assert hash_block(a, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])


# ---- KVCacheManager ----------------------------------------------------------------------------

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """Admit `request` the way the scheduler does and mark all its tokens computed."""
    cached = kv.find_cached_prefix(request)
    todo = request.num_tokens - len(cached) * kv.block_size
    assert kv.allocate(request, todo, cached)
    request.num_computed_tokens = request.num_tokens
    kv.commit_computed(request)


def test_allocate_sizes_to_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("a", list(range(5)))
    assert kv.allocate(r, 5)
    assert len(r.blocks) == 2
    r.num_computed_tokens = 5
    r.append_output(99)
    assert kv.allocate(r, 1)  # 6 tokens still fit in 2 blocks
    assert len(r.blocks) == 2
    r.num_computed_tokens = 6
    assert kv.allocate(r, 3)  # 9 tokens need a third
    assert len(r.blocks) == 3
    assert kv.pool.num_free_blocks == 5
    kv.free(r)
    assert r.blocks == [] and r.num_committed_blocks == 0
    kv.pool.check_all_free()


def test_allocate_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(12)))
    assert kv.allocate(a, 12)  # 3 blocks
    b = make_request("b", list(range(100, 108)))
    assert not kv.allocate(b, 8)  # needs 2, 1 free
    assert b.blocks == []
    assert kv.pool.num_free_blocks == 1
    assert kv.allocate(b, 4)  # 1 block fits
    assert kv.pool.num_free_blocks == 0
    kv.free(a)
    kv.free(b)
    kv.pool.check_all_free()


def test_failed_allocate_with_cached_prefix_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prefix = list(range(8))
    a = make_request("a", prefix + [50])
    compute_all(kv, a)
    kv.free(a)  # its 2 full blocks stay cached (evictable)
    assert kv.pool.num_cached_blocks == 2
    # b hits the 2 cached blocks but needs 3 more for its 12 extra tokens; only 2 others are free
    b = make_request("b", prefix + list(range(200, 212)))
    cached = kv.find_cached_prefix(b)
    assert len(cached) == 2
    assert not kv.allocate(b, 12, cached)
    assert b.blocks == []
    assert all(blk.ref_cnt == 0 for blk in cached)
    assert kv.pool.num_free_blocks == 4
    # the cached blocks were not taken nor evicted: still found
    assert kv.find_cached_prefix(b) == cached
    kv.pool.check_all_free()


def test_prefix_lookup_finds_only_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    compute_all(kv, a)
    assert kv.pool.num_cached_blocks == 2
    b = make_request("b", list(range(10)))
    hits = kv.find_cached_prefix(b)
    assert hits == a.blocks[:2]  # the partial third block is never a hit
    # a request diverging inside the second block only hits the first
    c = make_request("c", [0, 1, 2, 3, 4, 5, 6, 77, 8, 9])
    assert kv.find_cached_prefix(c) == a.blocks[:1]
    # diverging in the first token: nothing
    d = make_request("d", [9] + list(range(1, 10)))
    assert kv.find_cached_prefix(d) == []
    kv.free(a)
    kv.pool.check_all_free()


def test_exact_multiple_prompt_leaves_a_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(12)))  # exactly 3 blocks
    compute_all(kv, a)
    assert kv.pool.num_cached_blocks == 3
    b = make_request("b", list(range(12)))
    hits = kv.find_cached_prefix(b)
    assert hits == a.blocks[:2]
    assert b.num_tokens - len(hits) * BS == BS  # the last block is computed again, for its logits
    # one more token makes the third block usable
    c = make_request("c", list(range(13)))
    assert kv.find_cached_prefix(c) == a.blocks[:3]
    kv.free(a)
    kv.pool.check_all_free()


def test_shared_prefix_gets_same_blocks_and_stats() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = list(range(12))
    a = make_request("a", prefix + [40, 41])
    compute_all(kv, a)
    b = make_request("b", prefix + [60, 61, 62])
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == [blk.block_id for blk in a.blocks[:3]]
    free_before = kv.pool.num_free_blocks
    assert kv.allocate(b, b.num_tokens - 3 * BS, hits)
    assert b.blocks[:3] == a.blocks[:3]
    assert all(blk.ref_cnt == 2 for blk in b.blocks[:3])
    assert len(b.blocks) == 4  # 15 tokens
    assert kv.pool.num_free_blocks == free_before - 1  # only the tail block is new
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in b.blocks[:3])
    kv.free(b)
    kv.pool.check_all_free()


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(12)))
    compute_all(kv, a)
    kv.free(a)
    assert kv.find_cached_prefix(make_request("b", list(range(13)))) == []
    assert kv.pool.num_cached_blocks == 0


def test_prefix_cache_stats() -> None:
    stats = PrefixCacheStats()
    assert stats.hit_rate == 0.0
    stats.record(20, 0)
    stats.record(20, 12)
    assert (stats.requests, stats.hit_requests, stats.queried_tokens, stats.hit_tokens) == (2, 1, 40, 12)
    assert stats.hit_rate == pytest.approx(0.3)
