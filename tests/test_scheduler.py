"""The step scheduler driven like an engine loop: schedule(), sample for the chunks that complete
their known tokens, update(). Pure Python, no model."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.sampling import SamplingParams

EOS = 2
TOKEN = 7  # what the fake model samples unless told otherwise (never EOS)
BS = 4


def make_scheduler(num_blocks: int = 64, block_size: int = BS, prefix_caching: bool = True,
                   **config: object) -> Scheduler:
    # As the worker guarantees: the KV cache holds at least one request of max_model_len tokens.
    config.setdefault("max_model_len", num_blocks * block_size)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size, prefix_caching))


def make_request(rid: str, num_prompt: int, start: int = 0, max_tokens: int | None = 16,
                 **params: object) -> Request:
    """Prompt tokens start, start+1, ...; pass distinct `start`s to avoid sharing a prefix."""
    prompt = [start + 10 + i for i in range(num_prompt)]  # never EOS
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def step(sched: Scheduler, token: Callable[[Request], int] = lambda r: TOKEN) -> SchedulerOutput:
    """One engine step. Checks the token budget; samples for chunks that complete their known tokens."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert all(c.num_new_tokens > 0 for c in out.chunks)
    sampled = {c.request.request_id: [token(c.request)] for c in out.chunks if c.completes_known_tokens}
    changed = sched.update(out, sampled)
    assert {r.request_id for r, _ in changed} == set(sampled)
    return out


def run_until_idle(sched: Scheduler, token: Callable[[Request], int] = lambda r: TOKEN,
                   max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.num_unfinished:
        assert len(outs) < max_steps, "the scheduler stopped making progress"
        out = step(sched, token)
        assert out.chunks or out.preempted, "a step with unfinished requests scheduled nothing"
        outs.append(out)
    assert not sched.running and not sched.waiting and not sched.requests
    sched.kv.pool.check_all_free()
    return outs


def ids(out: SchedulerOutput) -> list[str]:
    return [c.request.request_id for c in out.chunks]


# ---- config and admission checks -----------------------------------------------------------------


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="role"):
        SchedulerConfig(role="both")
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)


def test_no_chunked_prefill_needs_budget_for_a_whole_prompt() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=2048)
    SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=2048, max_model_len=2048)


def test_prompt_at_max_model_len_is_rejected() -> None:
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="--max-model-len") as err:
        sched.add_request(make_request("a", 32))
    assert "32" in str(err.value)
    with pytest.raises(ValueError, match="--max-model-len"):
        sched.add_request(make_request("b", 40))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("c", 0))
    assert sched.num_unfinished == 0 and not sched.requests
    sched.add_request(make_request("d", 31))  # one token of room is enough
    run_until_idle(sched)


def test_duplicate_request_id_rejected() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 4, start=100))
    assert sched.num_unfinished == 1
    run_until_idle(sched)


# ---- budget, ordering, limits ------------------------------------------------------------------


def test_token_budget_respected_every_step() -> None:
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=16, max_num_seqs=8)
    lengths = [3, 40, 17, 1, 16, 25, 8, 2, 33]
    requests = [make_request(f"r{i}", n, start=100 * i, max_tokens=5) for i, n in enumerate(lengths)]
    for r in requests:
        sched.add_request(r)
    outs = run_until_idle(sched)
    assert all(out.num_batched_tokens <= 16 for out in outs)
    assert any(out.num_batched_tokens == 16 for out in outs)  # the budget is actually used
    # work conservation: every prompt token and every generated token but the last was computed once
    assert sum(out.num_batched_tokens for out in outs) == sum(n + 4 for n in lengths)
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 5 for r in requests)


def test_decodes_scheduled_before_new_prefills() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 4)
    sched.add_request(a)
    step(sched)
    assert len(a.output_token_ids) == 1
    b = make_request("b", 20, start=100)
    sched.add_request(b)
    out = step(sched)
    assert ids(out) == ["a", "b"]
    assert [c.num_new_tokens for c in out.chunks] == [1, 7]  # a's decode, then b gets the rest
    assert len(a.output_token_ids) == 2 and b.output_token_ids == []
    # a long running prefill never starves the decode
    for _ in range(2):
        out = step(sched)
        assert out.chunks[0].request is a and out.chunks[0].num_new_tokens == 1
    run_until_idle(sched)


def test_max_num_seqs_and_fcfs_admission() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 4, start=100 * i, max_tokens=3 + i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    first_seen: list[str] = []
    while sched.num_unfinished:
        out = step(sched)
        assert len(out.chunks) <= 2
        assert len(sched.running) <= 2
        for rid in ids(out):
            if rid not in first_seen:
                first_seen.append(rid)
    assert first_seen == ["r0", "r1", "r2", "r3"]
    # r2 could only start once r0 (the shortest) finished
    assert reqs[2].times.first_scheduled >= reqs[0].times.finished
    assert all(len(r.output_token_ids) == 3 + i for i, r in enumerate(reqs))
    sched.kv.pool.check_all_free()


def test_fcfs_under_a_tight_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=8)
    for i, n in enumerate([6, 6, 3, 2]):
        sched.add_request(make_request(f"r{i}", n, start=100 * i, max_tokens=2))
    out = step(sched)
    # r1 is chunked (4 of 6) rather than skipped for the smaller r2 and r3
    assert ids(out) == ["r0", "r1"]
    assert [c.num_new_tokens for c in out.chunks] == [6, 4]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    out = step(sched)
    assert ids(out) == ["r0", "r1", "r2", "r3"]
    assert [c.num_new_tokens for c in out.chunks] == [1, 2, 3, 2]
    run_until_idle(sched)


def test_chunked_prefill_over_several_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    r = make_request("long", 20, max_tokens=3)
    sched.add_request(r)
    chunks = []
    for _ in range(3):
        out = step(sched)
        (chunk,) = out.chunks
        chunks.append(chunk.num_new_tokens)
        if len(chunks) < 3:
            assert r.output_token_ids == [], "an intermediate chunk must not produce a token"
            assert r.times.first_token is None
    assert chunks == [8, 8, 4]
    assert r.num_computed_tokens == 20
    assert r.output_token_ids == [TOKEN]  # the final chunk produced the first token
    assert r.times.first_token is not None
    out = step(sched)
    assert out.chunks[0].num_new_tokens == 1
    run_until_idle(sched)
    assert len(r.output_token_ids) == 3


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    a = make_request("a", 10, max_tokens=4)
    b = make_request("b", 10, start=100, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert ids(out) == ["a"]  # b does not fit in the 6 tokens left and is not chunked
    out = step(sched)
    assert ids(out) == ["a", "b"]
    assert [c.num_new_tokens for c in out.chunks] == [1, 10]
    assert b.output_token_ids == [TOKEN]
    run_until_idle(sched)


# ---- finishing -----------------------------------------------------------------------------------


def test_max_tokens_finishes_with_length() -> None:
    sched = make_scheduler()
    r = make_request("a", 5, max_tokens=4)
    sched.add_request(r)
    outs = run_until_idle(sched)
    assert len(outs) == 4
    assert r.status is RequestStatus.FINISHED and r.finish_reason == "length"
    assert r.output_token_ids == [TOKEN] * 4
    assert r.times.finished is not None


def test_eos_finishes_with_stop_and_ignore_eos_keeps_going() -> None:
    def token(r: Request) -> int:
        return EOS if len(r.output_token_ids) == 2 else TOKEN  # EOS as the third token

    sched = make_scheduler()
    stops = make_request("stops", 5, max_tokens=10)
    ignores = make_request("ignores", 5, start=100, max_tokens=10, ignore_eos=True)
    sched.add_request(stops)
    sched.add_request(ignores)
    run_until_idle(sched, token)
    assert stops.finish_reason == "stop"
    assert stops.output_token_ids == [TOKEN, TOKEN, EOS]
    assert ignores.finish_reason == "length"
    assert len(ignores.output_token_ids) == 10 and ignores.output_token_ids[2] == EOS


def test_max_model_len_finishes_with_length() -> None:
    sched = make_scheduler(max_model_len=12)
    r = make_request("a", 8, max_tokens=None)
    sched.add_request(r)
    run_until_idle(sched)
    assert r.finish_reason == "length"
    assert len(r.output_token_ids) == 4 and r.num_tokens == 12


# ---- abort ---------------------------------------------------------------------------------------


def test_abort_waiting_running_and_unknown() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    running = make_request("running", 9)
    waiting = make_request("waiting", 4, start=100)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert running.status is RequestStatus.RUNNING and len(running.blocks) == 3
    assert sched.kv.pool.num_free_blocks == 13

    assert sched.abort("running") is running
    assert running.status is RequestStatus.FINISHED and running.finish_reason == "abort"
    assert running.blocks == [] and sched.kv.pool.num_free_blocks == 16
    assert running not in sched.running

    assert sched.abort("waiting") is waiting
    assert waiting.finish_reason == "abort" and not sched.waiting
    assert sched.num_unfinished == 0
    assert sched.abort("waiting") is None  # already gone
    assert sched.abort("nope") is None
    sched.kv.pool.check_all_free()
    assert sched.schedule().chunks == []


def test_abort_while_the_step_runs() -> None:
    sched = make_scheduler()
    a = make_request("a", 6)
    b = make_request("b", 6, start=100)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = {c.request.request_id: [TOKEN] for c in out.chunks if c.completes_known_tokens}
    sched.abort("a")
    changed = sched.update(out, sampled)
    assert changed == [(b, 1)]
    assert a.output_token_ids == [] and a.blocks == []
    run_until_idle(sched)


def test_abort_preallocated_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=8, role="decode")
    r = make_request("r", 9)
    assert sched.preallocate(r)
    assert sched.kv.pool.num_free_blocks == 5
    assert sched.abort("r") is r
    assert r.finish_reason == "abort" and not sched.preallocated
    assert sched.num_unfinished == 0
    sched.kv.pool.check_all_free()


# ---- preemption ----------------------------------------------------------------------------------


def test_preemption_of_the_newest_and_recompute() -> None:
    # 5 blocks of 4. a (4 tokens) needs a new block on step 2; b and c (6 tokens) not yet.
    sched = make_scheduler(num_blocks=5, prefix_caching=False, max_num_batched_tokens=64)

    def token(r: Request) -> int:
        return 1000 + len(r.output_token_ids)

    a = make_request("a", 4, max_tokens=10)
    b = make_request("b", 6, start=100, max_tokens=10)
    c = make_request("c", 6, start=200, max_tokens=10)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched, token)
    assert sched.kv.pool.num_free_blocks == 0
    d = make_request("d", 2, start=300, max_tokens=2)
    sched.add_request(d)

    out = step(sched, token)
    assert out.preempted == [c]  # the newest running request, not the oldest who ran short
    assert c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.blocks == [] and c.num_computed_tokens == 0
    assert c.output_token_ids == [1000]  # what it generated is kept
    assert list(sched.waiting) == [c, d]  # back at the head, ahead of d
    assert ids(out) == ["a", "b"]  # older ones progress; nothing new admitted this step
    assert len(a.output_token_ids) == 2 and len(b.output_token_ids) == 2
    assert sched.num_preemptions == 1

    resume_chunk = None
    outs = []
    while sched.num_unfinished:
        out = step(sched, token)
        outs.append(out)
        for chunk in out.chunks:
            if chunk.request is c and resume_chunk is None:
                resume_chunk = chunk
                # it recomputes prompt + generated tokens and samples its next one
                assert chunk.num_new_tokens == 6 + 1
        assert len(outs) < 200
    assert resume_chunk is not None
    sched.kv.pool.check_all_free()
    for r in (a, b, c):
        assert r.finish_reason == "length"
        assert r.output_token_ids == list(range(1000, 1010))
    assert d.finish_reason == "length" and len(d.output_token_ids) == 2


def test_newest_request_short_of_blocks_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=4, prefix_caching=False)
    a = make_request("a", 6, max_tokens=4)  # grows into a third block only at 9 tokens
    b = make_request("b", 8, start=100, max_tokens=4)  # needs a third block on step 2
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.kv.pool.num_free_blocks == 0
    out = step(sched)
    assert out.preempted == [b] and ids(out) == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.blocks == []
    assert list(sched.waiting) == [b]
    assert len(a.blocks) == 2 and len(a.output_token_ids) == 2
    run_until_idle(sched)
    assert b.finish_reason == "length" and len(b.output_token_ids) == 4


def test_abort_preempted_request() -> None:
    sched = make_scheduler(num_blocks=5, prefix_caching=False)
    a = make_request("a", 4, max_tokens=10)
    b = make_request("b", 6, start=100, max_tokens=10)
    c = make_request("c", 6, start=200, max_tokens=10)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    out = step(sched)
    assert out.preempted == [c]
    assert sched.abort("c") is c
    assert c.finish_reason == "abort" and not sched.waiting
    run_until_idle(sched)


def test_preemption_many_requests_all_finish() -> None:
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=24, max_num_seqs=6)
    reqs = [make_request(f"r{i}", 3 + 5 * (i % 3), start=100 * i, max_tokens=12) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    outs = run_until_idle(sched)
    assert sched.num_preemptions > 0
    assert any(out.preempted for out in outs)
    for r in reqs:
        assert r.finish_reason == "length" and len(r.output_token_ids) == 12


# ---- prefix caching through the scheduler ----------------------------------------------------------


def test_shared_prefix_through_scheduler() -> None:
    sched = make_scheduler(num_blocks=32)
    a = make_request("a", 14, max_tokens=4)  # 3 full blocks + 2
    sched.add_request(a)
    step(sched)
    b = Request("b", a.prompt_token_ids[:12] + [500, 501, 502, 503, 504], SamplingParams(max_tokens=4))
    sched.add_request(b)
    out = step(sched)
    chunk_b = out.chunks[1]
    assert chunk_b.request is b and chunk_b.num_new_tokens == 5
    assert [blk.block_id for blk in b.blocks[:3]] == [blk.block_id for blk in a.blocks[:3]]
    assert all(blk.ref_cnt == 2 for blk in b.blocks[:3])
    assert b.num_cached_tokens == 3 * BS
    stats = sched.kv.stats
    assert (stats.requests, stats.hit_requests, stats.queried_tokens, stats.hit_tokens) == (2, 1, 14 + 17, 12)
    run_until_idle(sched)


def test_shared_prefix_computed_count_starts_after_the_hit() -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=4)
    a = make_request("a", 13, max_tokens=1)
    sched.add_request(a)
    run_until_idle(sched)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=2))
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 3 * BS  # before this step's chunk is computed
    assert out.chunks[0].num_new_tokens == 1 and out.chunks[0].completes_known_tokens
    sched.update(out, {"b": [TOKEN]})
    assert b.output_token_ids == [TOKEN]
    run_until_idle(sched)


def test_the_load_report_counts_only_the_prompt_tokens_that_will_be_computed() -> None:
    """A burst on one prefix: the first prompt computes it, every later one finds it cached (admission predicts
    the time to first token from these counts); a prefix already cached counts for none of them."""
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    prefix = list(range(100, 116))  # 4 full blocks
    burst = [Request(f"r{i}", prefix + [200 + i, 300 + i], SamplingParams(max_tokens=2)) for i in range(5)]
    for r in burst:
        sched.add_request(r)
    assert sched.load()[0] == {0: 18 + 4 * 2}  # one whole prompt, then the tails
    other = make_request("other", 10, start=500)
    sched.add_request(other)
    assert sched.load()[0] == {0: 18 + 4 * 2 + 10}  # nothing of its prefix is cached or coming
    run_until_idle(sched)
    again = Request("again", prefix + [400, 401, 402], SamplingParams(max_tokens=2))
    sched.add_request(again)
    assert sched.load()[0] == {0: 3}  # its prefix stays cached from the burst


def test_a_burst_on_one_prefix_computes_the_prefix_once() -> None:
    """Prompts that share a prefix, all waiting at once with room for all in one step: the first computes the
    prefix alone, and the others take it from the cache the next step (one step later, arrival order kept),
    instead of computing it again beside it."""
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    prefix = list(range(100, 116))  # 4 full blocks
    burst = [Request(f"r{i}", prefix + [200 + i, 300 + i], SamplingParams(max_tokens=2)) for i in range(5)]
    for r in burst:
        sched.add_request(r)
    first = step(sched)
    assert [(c.request.request_id, c.num_new_tokens) for c in first.chunks] == [("r0", 18)]
    second = step(sched)
    assert [(c.request.request_id, c.num_new_tokens) for c in second.chunks] == [
        ("r0", 1), *((f"r{i}", 2) for i in range(1, 5))]
    assert all(r.num_cached_tokens == 16 for r in burst[1:])
    run_until_idle(sched)
    assert sched.kv.stats.hit_tokens == 4 * 16


def test_exact_block_multiple_prompt_is_not_fully_hit() -> None:
    sched = make_scheduler(num_blocks=32)
    a = make_request("a", 12, max_tokens=1)
    sched.add_request(a)
    run_until_idle(sched)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=1))
    sched.add_request(b)
    out = step(sched)
    assert out.chunks[0].num_new_tokens == BS  # the last block is recomputed for its logits
    assert b.num_cached_tokens == 2 * BS
    assert b.output_token_ids == [TOKEN]
    sched.kv.pool.check_all_free()


# ---- disaggregated roles -------------------------------------------------------------------------


def test_kv_producer_finishes_after_one_token_and_keeps_its_blocks() -> None:
    sched = make_scheduler(role="prefill", max_num_batched_tokens=8)
    short = make_request("short", 5, max_tokens=16)
    long = make_request("long", 19, start=100, max_tokens=16)
    for r in (short, long):
        r.kv_producer = True
        sched.add_request(r)
    outs = []
    while sched.num_unfinished:
        outs.append(step(sched))
    for r in (short, long):
        assert r.finish_reason == "prefilled"
        assert r.output_token_ids == [TOKEN]
        assert r.num_computed_tokens == r.num_prompt_tokens
    assert sum(out.num_batched_tokens for out in outs) == 5 + 19  # no decode step ever ran
    # The blocks stay with the requests until the KV is sent; then the connector frees them.
    assert len(short.blocks) == 2 and len(long.blocks) == 5
    for r in (short, long):
        sched.kv.free(r)
    sched.kv.pool.check_all_free()


def test_kv_producer_keeps_stop_reason_of_first_token() -> None:
    sched = make_scheduler(role="prefill")
    r = make_request("r", 5)
    r.kv_producer = True
    sched.add_request(r)
    step(sched, lambda r: EOS)
    assert r.finish_reason == "stop" and r.blocks
    sched.kv.free(r)
    sched.kv.pool.check_all_free()


def test_aborted_kv_producer_frees_its_blocks() -> None:
    sched = make_scheduler(role="prefill", max_num_batched_tokens=4)
    r = make_request("r", 9)
    r.kv_producer = True
    sched.add_request(r)
    step(sched)
    sched.abort("r")
    assert r.blocks == []
    sched.kv.pool.check_all_free()


def test_decode_role_preallocate_and_decode() -> None:
    sched = make_scheduler(num_blocks=6, role="decode")
    r = make_request("r", 9, max_tokens=4)
    assert sched.preallocate(r)
    assert r.status is RequestStatus.PREALLOCATED
    assert len(r.blocks) == 3  # 9 prompt tokens + the first generated one
    assert sched.kv.pool.num_free_blocks == 3
    assert sched.num_unfinished == 1
    assert sched.schedule().chunks == []  # nothing to compute until the prompt KV arrives

    # short of blocks: refused, holding nothing
    big = make_request("big", 12, start=100)
    assert not sched.preallocate(big)
    assert big.blocks == [] and big.status is RequestStatus.WAITING
    assert "big" not in sched.requests and "big" not in sched.preallocated
    assert sched.kv.pool.num_free_blocks == 3

    assert sched.mark_prefilled("r", 42) is r
    assert r.status is RequestStatus.RUNNING and r.output_token_ids == [42]
    assert r.num_computed_tokens == 9
    for expected_outputs in (2, 3, 4):
        out = step(sched)
        (chunk,) = out.chunks
        assert chunk.request is r and chunk.num_new_tokens == 1
        assert len(r.output_token_ids) == expected_outputs
    assert r.finish_reason == "length" and r.output_token_ids == [42, TOKEN, TOKEN, TOKEN]
    assert sched.num_unfinished == 0
    sched.kv.pool.check_all_free()


def test_decode_role_first_token_can_finish() -> None:
    sched = make_scheduler(role="decode")
    r = make_request("r", 5, max_tokens=4)
    assert sched.preallocate(r)
    sched.mark_prefilled("r", EOS)
    assert r.finish_reason == "stop" and r.blocks == []
    assert sched.num_unfinished == 0
    sched.kv.pool.check_all_free()


def test_decode_role_preallocate_checks_length() -> None:
    sched = make_scheduler(role="decode", max_model_len=16)
    with pytest.raises(ValueError, match="--max-model-len"):
        sched.preallocate(make_request("r", 16))
    sched.kv.pool.check_all_free()


def test_decode_role_duplicate_preallocate_rejected() -> None:
    sched = make_scheduler(num_blocks=8, role="decode")
    first = make_request("r", 5)
    assert sched.preallocate(first)
    with pytest.raises(ValueError, match="already in use"):
        sched.preallocate(make_request("r", 5))
    assert sched.kv.pool.num_free_blocks == 6  # the second one took nothing
    sched.abort("r")
    sched.kv.pool.check_all_free()


# ---- --scheduling-policy priority ----------------------------------------------------------------


def test_priority_orders_the_waiting_queue_then_arrival() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    requests = [make_request(rid, 4, start=100 * i, max_tokens=1) for i, rid in enumerate("abcd")]
    for r, priority in zip(requests, (5, 0, 5, -1), strict=True):
        r.priority = priority
        sched.add_request(r)
    order = [ids(out)[0] for out in run_until_idle(sched)]
    assert order == ["d", "b", "a", "c"]  # lower first; a before c by arrival


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler(max_num_seqs=1)
    requests = [make_request(rid, 4, start=100 * i, max_tokens=1) for i, rid in enumerate("abc")]
    for r, priority in zip(requests, (5, 0, -1), strict=True):
        r.priority = priority
        sched.add_request(r)
    assert [ids(out)[0] for out in run_until_idle(sched)] == ["a", "b", "c"]


def test_priority_preempts_the_lowest_priority_even_if_scheduled_earlier() -> None:
    # b (priority 9) runs alone first; then a (1) and c (0) come. When a runs short of blocks, the victim
    # is b, which was scheduled earlier in the same step: its chunk leaves the step with it.
    sched = make_scheduler(num_blocks=5, prefix_caching=False, max_num_batched_tokens=64, policy="priority")
    b = make_request("b", 6, start=100, max_tokens=10)
    a = make_request("a", 4, max_tokens=10)
    c = make_request("c", 6, start=200, max_tokens=10)
    b.priority, a.priority, c.priority = 9, 1, 0
    sched.add_request(b)
    step(sched)
    sched.add_request(a)
    sched.add_request(c)
    assert ids(step(sched)) == ["b", "c", "a"]  # c before a: priority order
    assert sched.kv.pool.num_free_blocks == 0
    out = step(sched)
    assert out.preempted == [b] and ids(out) == ["c", "a"]
    assert out.num_batched_tokens == 2
    assert list(sched.waiting) == [b]
    run_until_idle(sched)
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 10 for r in (a, b, c))


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling-policy"):
        make_scheduler(policy="lifo")


# ---- LoRA adapters ---------------------------------------------------------------------------------

def test_a_step_holds_at_most_max_loras_adapters_and_the_others_wait_their_turn() -> None:
    sched = make_scheduler(max_loras=2)
    requests = [make_request(f"{name}-{i}", 5, start=10 * i, max_tokens=3)
                for i, name in enumerate(["sql", "chat", "sql", "code", "base"])]
    for r in requests:
        r.lora_name = None if r.request_id.startswith("base") else r.request_id.split("-")[0]
        sched.add_request(r)
    step(sched)
    assert sched.load()[4] == ["chat", "sql"]  # the load report's adapters in slots: routers prefer it for them
    outs = run_until_idle(sched)
    for out in outs:
        assert len({c.request.lora_name for c in out.chunks} - {None}) <= 2
    assert ids(outs[0]) == ["sql-0", "chat-1", "sql-2"]  # "code" waits at the head, and the base behind it
    code_start = next(i for i, o in enumerate(outs) if "code-3" in ids(o))
    assert code_start > 0 and "base-4" in ids(outs[code_start])
