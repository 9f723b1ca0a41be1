"""Block tables per layer group (config/layer_groups.py, engine/group_tables.py): a sliding-window group holds only
its window's blocks as a sequence grows, a prefix hit needs the window's blocks of every sliding group, and every
block comes back."""

from __future__ import annotations

from pdserve.config.layer_groups import LayerGroups, group_key
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import TOKEN, make_request, run_until_idle, step

BS = 4
WINDOW = 10  # a query sees itself and the 9 keys before it: 3 or 4 blocks of 4


def _scheduler(num_blocks: int = 200, groups: LayerGroups | None = None, **config: object) -> Scheduler:
    groups = groups or LayerGroups(((2,), (0,), (1,)), (0, WINDOW, WINDOW))
    config.setdefault("max_model_len", 400)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, BS, True, groups))


def _held(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv.groups.held(sched.requests[rid])


def test_gemma3_270m_layers_make_six_groups_of_three():
    windows = tuple(0 if i % 6 == 5 else 512 for i in range(18))
    groups = LayerGroups.by_window(windows)
    assert groups.layers[0] == (5, 11, 17) and groups.windows == (0, 512, 512, 512, 512, 512)
    assert groups.slots == 3 and groups.place(6) == (2, 2)
    # 1B: 26 layers, 4 global; the sliding ones fill five groups of 4 and one of 2
    groups = LayerGroups.by_window(tuple(0 if i % 6 == 5 else 512 for i in range(26)))
    assert [len(g) for g in groups.layers] == [4, 4, 4, 4, 4, 4, 2] and groups.slots == 4
    assert LayerGroups.by_window((0, 0, 0)).num_groups == 1


def test_a_sliding_group_holds_only_its_windows_blocks_as_the_sequence_grows():
    sched = _scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 40, max_tokens=30))
    step(sched)  # 16 prompt tokens: 4 blocks in every group
    assert _held(sched, "a") == [4, 4, 4]
    for _ in range(3):
        step(sched)  # the rest of the prompt, then decodes
    request = sched.requests["a"]
    at = request.num_computed_tokens - 1  # the position the last step's allocation was for
    live = -(-(at + 1) // BS) - (at - WINDOW + 1) // BS
    assert _held(sched, "a") == [len(request.blocks), live, live]
    assert live <= 4 < len(request.blocks)
    used = sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks
    assert used == len(request.blocks) + 2 * live
    run_until_idle(sched)


def test_a_prefix_hit_takes_the_windows_blocks_of_every_group_and_they_come_back():
    sched = _scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("a", 41, max_tokens=1))
    run_until_idle(sched)
    sched.add_request(make_request("b", 41, max_tokens=1))
    out = step(sched)
    b = sched.requests.get("b") or out.chunks[0].request
    assert b.num_cached_tokens == 40  # every full block: the last token is computed
    assert out.chunks[0].num_new_tokens == 1
    run_until_idle(sched)


def test_a_prefix_evicted_by_other_requests_is_computed_again_and_every_block_comes_back():
    sched = _scheduler(num_blocks=40, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 41, max_tokens=1))
    run_until_idle(sched)
    for i, start in enumerate((1000, 2000, 3000)):  # others fill the pool: a's cached blocks are evicted
        sched.add_request(make_request(f"x{i}", 41, start=start, max_tokens=1))
        run_until_idle(sched)
    sched.add_request(make_request("b", 41, max_tokens=1))
    out = step(sched)
    assert out.chunks[0].request.num_cached_tokens < 40
    run_until_idle(sched)


def test_blocks_run_short_preempt_and_every_block_comes_back():
    sched = _scheduler(num_blocks=30, max_num_batched_tokens=32, max_num_seqs=4)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 20, start=100 * i, max_tokens=40))
    outs = run_until_idle(sched, lambda r: TOKEN)
    assert any(o.preempted for o in outs)


def test_speculative_proposals_past_the_window_are_trimmed_in_every_group():
    sched = _scheduler(max_num_batched_tokens=64)
    request = make_request("a", 30, max_tokens=8)
    sched.add_request(request)
    step(sched)
    before = _held(sched, "a")
    sched.kv.allocate(request, 9)  # room for 8 proposals
    assert _held(sched, "a")[0] > before[0]
    sched.kv.trim(request)
    assert len(request.group_blocks[0]) == len(request.blocks) == -(-request.num_tokens // BS)
    run_until_idle(sched)


def test_only_the_flag_keeps_one_table():
    """`--disable-hybrid-kv-cache-manager` keeps one table for every layer; PD roles, KV events, the host and disk
    tiers and prefix pulls group."""
    from pdserve.config.engine import EngineConfig
    from pdserve.config.layer_groups import layer_groups_for
    from pdserve.config.model import ModelConfig, RopeConfig

    gemma = ModelConfig("gemma3_text", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=6, num_heads=1,
                        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=32768,
                        rope=RopeConfig(), layer_windows=(512,) * 5 + (0,))
    assert layer_groups_for(gemma, EngineConfig().one_block_table_reason()).num_groups == 6  # groups of one layer
    for flags in ({"splitwise_role": "decode"}, {"splitwise_role": "prefill"}, {"enable_role_switch": True},
                  {"kv_events_config": {"enable_kv_cache_events": True}}, {"swap_space": 1.0},
                  {"swap_space": 1.0, "kv_disk_path": "/tmp/x"}, {"swap_space": 1.0, "enable_kv_pull": True}):
        assert EngineConfig(**flags).one_block_table_reason() is None
    why = EngineConfig(disable_hybrid_kv_cache_manager=True).one_block_table_reason()
    assert "--disable-hybrid" in why and layer_groups_for(gemma, why) is None


def test_the_load_calibrations_steps_run_on_a_model_with_layer_groups(tmp_path):
    """The worker times calibration steps with a table for every layer group (the same blocks for each)."""
    from pdserve.worker.calibration import step_chunks
    from pdserve.worker.model_runner import ModelRunner
    from tests.tiny_models import make_tiny_model

    make_tiny_model("gemma3", tmp_path)
    runner = ModelRunner(tmp_path, dtype="float32", device="cpu", block_size=8, one_block_table_reason=None)
    layout = runner.layout(64)
    assert layout.layer_groups is not None and layout.layer_groups.num_groups == 2
    runner.allocate_kv_cache(64)
    chunks = step_chunks(4, 20, 40, 8, layout.layer_groups.num_groups)
    assert all(len(c.group_tables) == 1 for c in chunks)
    assert runner.logits(chunks).shape[0] == 5


def test_a_hit_ends_where_every_sliding_group_still_has_the_window_before_it():
    """Group 0 holds six cached blocks; the sliding group (a window of 8 tokens: the query's block and the one
    before) lost block 4: a hit of 6 or 5 blocks would need it, one of 4 needs blocks 2 and 3 only."""
    from pdserve.engine.block_pool import BlockPool
    from pdserve.engine.group_tables import GroupTables

    pool = BlockPool(32)
    tables = GroupTables(LayerGroups(((1,), (0,)), (0, 8)), pool, BS)
    hashes = [bytes([i]) * 32 for i in range(6)]
    for i, h in enumerate(hashes):
        for key in (h, *([group_key(1, h)] if i != 4 else [])):
            (block,) = pool.allocate(1)
            pool.cache_full_block(block, key)
            pool.free([block])
    assert tables.cached_run(hashes, 6) == 4
    assert tables.cached_run(hashes, 3) == 3
    assert tables.cached_run(hashes, 6, coming={hashes[4]}) == 6  # a request ahead computes block 4 first


def test_the_load_report_counts_a_prefix_cached_in_every_group():
    sched = _scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("a", 41, max_tokens=1))
    run_until_idle(sched)
    again, other = make_request("b", 41, max_tokens=1), make_request("c", 41, start=500, max_tokens=1)
    assert sched.kv.expected_cached_blocks(again, set()) == 10
    assert sched.kv.expected_cached_blocks(other, set()) == 0


def test_kv_events_name_each_groups_blocks_and_a_router_indexes_the_full_attention_group():
    """Each group's blocks are stored and removed under the token hashes with the group's index, kind and window
    (vLLM's fields); a router's index keeps group 0's, so a sliding group's eviction leaves the prefix indexed."""
    from pdserve.kv_events.events import BlockRemoved, BlockStored
    from pdserve.kv_events.index import KVIndex

    sched = _scheduler(num_blocks=40, max_num_batched_tokens=64)
    recorder = sched.kv.record_events()
    index = KVIndex()
    index.set_sources("http://e", ["e#0"])  # not contacted
    sched.add_request(make_request("a", 41, max_tokens=1))
    a = sched.requests["a"]
    run_until_idle(sched)
    events = recorder.take()
    stored = {e.group_idx: e for e in events if isinstance(e, BlockStored)}
    assert (stored[0].kv_cache_spec_kind, stored[0].kv_cache_spec_sliding_window) == ("full_attention", None)
    assert (stored[1].kv_cache_spec_kind, stored[1].kv_cache_spec_sliding_window) == ("sliding_window", WINDOW)
    # one 41-token step wrote every block of every group before its window moved on: all 10 full ones are cached
    assert stored[0].block_hashes == stored[1].block_hashes == stored[2].block_hashes == a.block_hashes[:10]
    index.apply("e#0", events)
    assert set(index.blocks("e#0")) == set(a.block_hashes[:10])

    sched.add_request(make_request("b", 40, start=500, max_tokens=1))  # another prompt: the pool evicts
    run_until_idle(sched)
    events = recorder.take()
    removed = {e.group_idx for e in events if isinstance(e, BlockRemoved)}
    assert 1 in removed and all(len(h) == 32 for e in events for h in e.block_hashes)
    index.apply("e#0", events)
    assert set(index.blocks("e#0")) == {h for h in sched.kv.pool.cached_hashes() if len(h) == 32}
    assert set(sched.kv.snapshot()[0].block_hashes) == set(index.blocks("e#0"))  # a late subscriber's view


def test_the_host_tier_keeps_each_groups_blocks_and_a_hit_brings_back_the_windows():
    """With --swap-space, freed blocks of every group are saved to host memory under their group's key; after the
    device cache lost them, the same prompt finds group 0's whole run there and each sliding group's window before
    its end, copied back into device blocks with the right content (the test copier's number per block)."""
    from pdserve.engine.request import Request
    from pdserve.sampling import SamplingParams
    from tests.test_host_tier import ArrayCopier

    kv = KVCacheManager(24, BS, True, LayerGroups(((1,), (0,)), (0, 8)))  # a window of 8 tokens: 2 blocks
    copier = ArrayCopier(24, 40)
    kv.add_host_tier(40, copier)

    def run(rid: str, first: int) -> Request:
        request = Request(rid, list(range(first, first + 33)), SamplingParams(max_tokens=1))
        cached = kv.find_cached_prefix(request)
        assert kv.allocate(request, 33 - len(cached) * BS, cached)
        for i, block in enumerate(request.blocks[len(cached):], len(cached)):
            copier.device[block.block_id] = first + i  # group 0's block i
        for i, block in enumerate(request.group_blocks[0]):
            if block is not None and i >= len(cached):
                copier.device[block.block_id] = 1000 + first + i  # the sliding group's
        request.num_computed_tokens = 33
        kv.commit_computed(request)
        request.hits = cached  # type: ignore[attr-defined]
        return request

    kv.free(run("a", 100))
    copier.complete_saves(kv)
    assert kv.host.num_used_blocks == 16  # 8 full blocks in each group
    kv.free(run("b", 500))  # another prompt takes most of the device cache
    copier.complete_saves(kv)
    again = run("a2", 100)
    assert len(again.hits) == 8 and copier.loads > 0
    assert [copier.device[b.block_id] for b in again.blocks[:8]] == [100 + i for i in range(8)]
    window = again.group_blocks[0]
    assert all(b is None for b in window[:6])  # a query at token 32 sees tokens 25-32: blocks 6, 7 and 8
    assert [copier.device[b.block_id] for b in window[6:8]] == [1106, 1107]
    assert kv.host.stats.hit_blocks == 8 + 2  # all from the host tier: group 0's run and the window
    kv.free(again)
    copier.complete_saves(kv)
    kv.pool.check_all_free()


def test_a_pull_brings_the_peers_run_and_each_sliding_groups_window_before_its_end():
    """A router's hint names a peer holding the prompt's 4 full blocks: the pull asks for group 0's 4 and the sliding
    group's window before block 4 (blocks 2 and 3: a window of 8 tokens), under the group's keys; the hit is then
    all 4 blocks, with the window's contents in the sliding group's table."""
    from pdserve.engine.prefix_pull import PullCost, PullHint
    from pdserve.engine.request import Request
    from pdserve.sampling import SamplingParams
    from tests.test_prefix_pull import PROMPT, PullingCopier

    kv = KVCacheManager(16, BS, True, LayerGroups(((1,), (0,)), (0, 8)))
    copier = PullingCopier(16, 16)
    kv.add_host_tier(16, copier)
    kv.add_prefix_pulls(PullCost(block_bytes=100, block_size=BS, prefill_rate=lambda: 1e3))
    request = Request("r", PROMPT, SamplingParams(max_tokens=1), kv_pull=PullHint("127.0.0.1:1", 4))  # not contacted
    kv._hash_full_blocks(request, len(PROMPT) - 1)
    hashes = request.block_hashes
    copier.peer = {h: float(i) for i, h in enumerate(hashes)} | {group_key(1, h): 100.0 + i for i, h in
                                                                 enumerate(hashes)}
    assert kv.find_cached_prefix(request) is None  # the pull runs
    assert copier.asked == [hashes + [group_key(1, hashes[2]), group_key(1, hashes[3])]]
    assert kv.finish_loads() == ["r"]
    prefix = kv.find_cached_prefix(request)
    assert kv.allocate(request, len(PROMPT) - len(prefix) * BS, prefix)
    assert [copier.device[b.block_id] for b in prefix] == [0.0, 1.0, 2.0, 3.0]
    window = request.group_blocks[0]
    assert window[:2] == [None, None] and [copier.device[b.block_id] for b in window[2:4]] == [102.0, 103.0]


def test_a_run_that_goes_on_past_a_device_gap_takes_the_device_blocks_and_loads_the_rest():
    """Group 0's block 5 is still on the device (held there while its host copy ran, say) while blocks 0-4 and 6-7
    went: the hit takes block 5 as it is and loads the others from the host tier, in one run of 8."""
    from pdserve.engine.request import Request
    from pdserve.sampling import SamplingParams
    from tests.test_host_tier import ArrayCopier

    kv = KVCacheManager(24, BS, True, LayerGroups(((1,), (0,)), (0, 8)))
    copier = ArrayCopier(24, 40)
    kv.add_host_tier(40, copier)
    first = Request("a", list(range(100, 133)), SamplingParams(max_tokens=1))
    assert kv.allocate(first, 33)
    for i, block in enumerate(first.blocks):
        copier.device[block.block_id] = 100 + i
    first.num_computed_tokens = 33
    kv.commit_computed(first)
    hashes = first.block_hashes
    kv.free(first)
    copier.complete_saves(kv)
    kv.reset_prefix_cache()  # the device forgets; the host tier is refilled below from what was saved
    for h, value in zip(hashes, range(100, 108), strict=False):
        kv.host.saved(h, host := kv.host.reserve(h), from_device=False)
        copier.host[host] = value
        kv.host.saved(group_key(1, h), host := kv.host.reserve(group_key(1, h)), from_device=False)
        copier.host[host] = 1000 + value
    (block,) = kv.pool.allocate(1)  # block 5 back on the device, cached
    copier.device[block.block_id] = 105
    kv.pool.cache_full_block(block, hashes[5])
    kv.pool.free([block])
    again = Request("b", list(range(100, 133)), SamplingParams(max_tokens=1))
    hits = kv.find_cached_prefix(again)
    assert [copier.device[b.block_id] for b in hits] == [100 + i for i in range(8)]
    assert hits[5] is block
    assert kv.allocate(again, 33 - 8 * BS, hits)
    assert [copier.device[b.block_id] for b in again.group_blocks[0][6:8]] == [1106, 1107]
