"""A PD request's lifecycle, P against D in one process: the real connectors and schedulers over a real
control channel (ZMQ on localhost), a fake clock and a stand-in cache service (it reports transfers
as the test says; no KV moves). Covers the phases and lease rules of pdserve/disagg/lifecycle.py
in milliseconds, where tests/test_pd.py needs whole deployments.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from pdserve.config.engine import EngineConfig
from pdserve.config.layer_groups import LayerGroups
from pdserve.disagg.connector_base import prompt_digest
from pdserve.disagg.decode_connector import DecodeConnector
from pdserve.disagg.lifecycle import (
    DECODE_TRANSITIONS,
    PREFILL_TRANSITIONS,
    QUARANTINE_GRACE,
    QUEUE_TIMEOUT_LEASES,
    DecodePhase,
    IllegalTransition,
    PrefillPhase,
    check_transition,
)
from pdserve.disagg.messages import CacheInfo, PDError, SwapDone, TransferDone
from pdserve.disagg.prefill_connector import PrefillConnector
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.messages import PDParams, RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.http.errors import PD_ERROR
from pdserve.kv.layout import KVLayout
from pdserve.sampling import SamplingParams
from pdserve.transport import RdmaEndpoint, TcpEndpoint

BLOCK = 4
LEASE = 10.0
_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class FakeCacheService:
    """The cache service as a connector sees it: transfer reports come when the test puts them in."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.PAIR)  # polled by the engine loop; never speaks here
        self.reports: list[TransferDone] = []
        self.extended: list[tuple[str, float]] = []
        self.refused_connections = 0
        self.swaps: list[tuple[str, list[int], list[int]]] = []

    def swap_in(self, transfer_id: str, buffer_blocks: list[int], cache_blocks: list[int]) -> None:
        self.swaps.append((transfer_id, buffer_blocks, cache_blocks))

    def transfer_reports(self) -> list[TransferDone | SwapDone]:
        out, self.reports = self.reports, []
        return out

    def extend_deadline(self, transfer_id: str, deadline: float) -> None:
        self.extended.append((transfer_id, deadline))


class Side:
    def __init__(self, role: str, num_blocks: int, ctx: zmq.Context, buffer_blocks: int = 0,
                 prefix_caching: bool = False, groups: LayerGroups | None = None, chunk: int = 2048) -> None:
        self.config = EngineConfig(splitwise_role=role, block_size=BLOCK, pd_transfer_timeout=LEASE,
                                   cache_transfer_protocol=("tcp",), enable_prefix_caching=prefix_caching)
        self.clock = Clock()
        self.num_blocks = num_blocks
        kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching, layer_groups=groups)
        self.scheduler = Scheduler(SchedulerConfig(role=role, max_model_len=256, max_num_batched_tokens=chunk), kv)
        self.service = FakeCacheService(ctx)
        layout = KVLayout(num_blocks, 1 if groups else 2, BLOCK, 1, 16, "float32", groups)
        if role == "prefill":
            self.conn = PrefillConnector(self.config, self.scheduler, layout, ctx, self.service, self.clock)
        else:
            self.conn = DecodeConnector(self.config, self.scheduler, layout, ctx, [TcpEndpoint("127.0.0.1", 1)],
                                        self.service, self.clock, buffer_blocks=buffer_blocks)

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv.pool.num_free_blocks


@pytest.fixture
def pd():
    ctx = zmq.Context()
    p, d = Side("prefill", 16, ctx), Side("decode", 16, ctx)
    yield p, d
    for side in (p, d):
        side.conn.close()
        side.service.sock.close()
    ctx.term()


def request(n_prompt: int = 10) -> Request:
    return Request(f"r{next(_ids)}", list(range(1, n_prompt + 1)), SamplingParams(max_tokens=8))


def submit(p: Side, d: Side, n_prompt: int = 10) -> tuple[str, Request, Request]:
    tid = f"t{next(_ids)}"
    rp, rd = request(n_prompt), request(n_prompt)
    assert p.conn.add_request(rp, PDParams(tid, "prefill")) == []
    assert d.conn.add_request(rd, PDParams(tid, "decode", prefill_addr=f"127.0.0.1:{p.conn.port}")) == []
    return tid, rp, rd


def pump(p: Side, d: Side, until, timeout: float = 5.0) -> tuple[list[RequestOutput], list[RequestOutput]]:  # noqa: ANN001
    """Poll both sides (messages cross a real socket) until `until()` holds; their outputs."""
    p_out, d_out = [], []
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the two sides did not get there"
        p_out += p.conn.poll()
        d_out += d.conn.poll()
        time.sleep(0.002)
    return p_out, d_out


def prefill_step(p: Side, rp: Request | None = None, token: int = 42) -> None:
    """What P's engine does for one step: schedule, plan the writes, sample, report the first tokens
    (of `rp`, which must be in the step, or of every request scheduled)."""
    out = p.scheduler.schedule()
    plans = p.conn.transfers(out.chunks)
    assert len(plans) == len(out.chunks)
    done = [c.request for c in out.chunks if rp is None or c.request is rp]
    assert done, "the request was not scheduled"
    p.scheduler.update(out, {r.request_id: [token] for r in done})
    for r in done:
        p.conn.on_prefilled(r, token, None)


def test_a_transfer_runs_through_every_phase_and_frees_p_on_ds_ack(pd):
    p, d = pd
    tid, rp, rd = submit(p, d)
    assert p.conn.phase_of(tid) is PrefillPhase.AWAITING_CACHE_INFO
    assert p.free_blocks == p.num_blocks  # P holds nothing while D decides
    assert d.conn.phase_of(tid) is DecodePhase.PREALLOCATED
    assert d.free_blocks == d.num_blocks - 3  # a 10-token prompt + its first token: 3 blocks of 4

    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    prefill_step(p, rp)
    assert p.conn.phase_of(tid) is PrefillPhase.PREFILLED
    assert p.free_blocks == p.num_blocks - 3  # kept until the KV is surely D's

    p.service.reports.append(TransferDone(tid, ok=True, nbytes=1234, first_write=1.0, last_write=2.0))
    p_out, d_out = pump(p, d, lambda: d.conn.phase_of(tid) is None)
    assert p_out == []
    assert [(o.request_id, o.new_token_ids) for o in d_out] == [(rd.request_id, [42])]
    assert rd in d.scheduler.running and rd.output_token_ids == [42]  # decoding from P's first token
    pump(p, d, lambda: p.conn.phase_of(tid) is None)  # D's ack
    assert p.free_blocks == p.num_blocks
    assert p.conn.transfer_stats.transfers_ok == d.conn.transfer_stats.transfers_ok == 1


def test_ds_lease_ends_without_prefill_done_and_both_sides_let_go(pd):
    p, d = pd
    tid, rp, rd = submit(p, d)
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    d.clock.now += LEASE + 0.1  # P went silent (no LeaseRenew reached D)
    p_out, d_out = pump(p, d, lambda: p.conn.phase_of(tid) is None)
    assert [o.error_type for o in d_out] == [PD_ERROR] and "--pd-transfer-timeout" in d_out[0].error
    assert [o.error_type for o in p_out] == [PD_ERROR] and "the decode instance gave up" in p_out[0].error
    assert p.free_blocks == p.num_blocks and rp.is_finished
    # D's blocks stay out of the pool until P can no longer be writing into them
    assert d.free_blocks == d.num_blocks - 3
    assert d.conn.stats().quarantined_blocks == 3
    d.clock.now += QUARANTINE_GRACE + 0.1
    d.conn.poll()
    assert d.free_blocks == d.num_blocks


def test_p_renews_the_lease_while_it_holds_the_request(pd):
    p, d = pd
    tid, rp, rd = submit(p, d)
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    p.clock.now += LEASE / 3 + 0.1  # P is still queueing the prompt: it renews
    p.conn.poll()
    d.clock.now += LEASE - 1  # D's original lease is nearly over; the renewal extends it
    pump(p, d, lambda: d.conn._by_tid[tid].lease_deadline > d.clock.now + 1)
    d.clock.now += 2  # past the original lease, inside the renewed one
    assert d.conn.poll() == [] and d.conn.phase_of(tid) is DecodePhase.PREALLOCATED


def test_a_failed_write_fails_p_and_d_gives_its_blocks_up(pd):
    p, d = pd
    tid, rp, rd = submit(p, d)
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    prefill_step(p, rp)
    p.service.reports.append(TransferDone(tid, ok=False, error="connection reset"))
    p_out, d_out = pump(p, d, lambda: d.conn.phase_of(tid) is None)
    assert p_out == []  # P's answer (the first token) went out already; only its blocks were left
    assert p.free_blocks == p.num_blocks
    assert len(d_out) == 1 and "connection reset" in d_out[0].error and d_out[0].error_type == PD_ERROR
    assert d.conn.stats().quarantined_blocks == 3


def test_d_queues_for_blocks_in_order_and_gives_up_after_its_queue_timeout(pd):
    p, d = pd
    first = submit(p, d, n_prompt=40)  # 11 blocks of D's 16
    second = submit(p, d, n_prompt=40)
    assert d.conn.phase_of(first[0]) is DecodePhase.PREALLOCATED
    assert d.conn.phase_of(second[0]) is DecodePhase.QUEUED
    assert d.conn.stats().queued_for_blocks == 1
    d.clock.now += QUEUE_TIMEOUT_LEASES * LEASE + 1  # the first one's lease ends too (P stays silent)
    p_out, d_out = pump(p, d, lambda: p.conn.phase_of(first[0]) is None and p.conn.phase_of(second[0]) is None)
    d_errors = {o.request_id: o.error for o in d_out}
    assert "no free KV blocks" in d_errors[second[2].request_id]
    assert "--pd-transfer-timeout" in d_errors[first[2].request_id]
    p_errors = {o.request_id: o.error for o in p_out}  # P hears of the queued one while waiting for its info
    assert "no free KV blocks" in p_errors[second[1].request_id]
    assert d.conn.stats().queued_for_blocks == 0


def test_aborting_on_p_before_cache_info_ends_it_there_and_tells_d(pd):
    p, d = pd
    tid, rp, rd = submit(p, d)
    assert p.conn.abort(rp.request_id) is rp and rp.finish_reason == "abort"
    assert p.conn.phase_of(tid) is None
    _, d_out = pump(p, d, lambda: d.conn.phase_of(tid) is None)
    assert "aborted" in d_out[0].error and d.conn.stats().quarantined_blocks == 3


def test_aborting_on_d_while_queued_tells_p_nothing_and_holds_nothing(pd):
    p, d = pd
    submit(p, d, n_prompt=40)
    tid, rp, rd = submit(p, d, n_prompt=40)
    assert d.conn.abort(rd.request_id) is rd and rd.finish_reason == "abort"
    time.sleep(0.05)
    assert p.conn.poll() == [] and p.conn.phase_of(tid) is PrefillPhase.AWAITING_CACHE_INFO


@pytest.mark.parametrize("table", [PREFILL_TRANSITIONS, DECODE_TRANSITIONS], ids=["prefill", "decode"])
def test_the_transition_tables_allow_only_their_edges_and_every_phase_can_end(table):
    phases = list(table)
    for src, dst in itertools.product(phases, phases):
        if dst in table[src]:
            check_transition(table, src, dst, "t")
        else:
            with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
                check_transition(table, src, dst, "t")
    terminal = {ph for ph in phases if not table[ph]}
    for ph in phases:  # from every phase some terminal phase is reachable
        seen, todo = {ph}, [ph]
        while todo:
            for nxt in table[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert seen & terminal, ph


def test_kv_written_before_the_first_token_is_seen_still_ends_in_one_prefill_done(pd):
    p, d = pd
    tid, rp, rd = submit(p, d)
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    p.service.reports.append(TransferDone(tid, ok=True, nbytes=10))
    p.conn.poll()
    assert p.conn.phase_of(tid) is PrefillPhase.KV_WRITTEN
    prefill_step(p, rp, token=7)
    assert p.conn.phase_of(tid) is PrefillPhase.DONE_SENT
    _, d_out = pump(p, d, lambda: d.conn.phase_of(tid) is None)
    assert [o.new_token_ids for o in d_out] == [[7]]


def test_aborting_on_d_while_preallocated_fails_p_and_quarantines_ds_blocks(pd):
    p, d = pd
    tid, rp, rd = submit(p, d)
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    assert d.conn.abort(rd.request_id) is rd and rd.finish_reason == "abort"
    assert d.conn.stats().quarantined_blocks == 3
    p_out, _ = pump(p, d, lambda: p.conn.phase_of(tid) is None)
    assert "aborted" in p_out[0].error and p.free_blocks == p.num_blocks


def test_cache_info_for_another_layout_is_refused_on_both_sides(pd):
    p, d = pd
    d.conn.layout = KVLayout(16, 2, BLOCK, 2, 16, "float32")  # two KV heads: another model
    tid, rp, rd = submit(p, d)
    p_out, d_out = pump(p, d, lambda: d.conn.phase_of(tid) is None and p.conn.phase_of(tid) is None)
    assert "layouts differ" in p_out[0].error and "layouts differ" in d_out[0].error
    assert p.free_blocks == p.num_blocks


def test_kv_computed_under_another_lora_adapter_is_refused_on_both_sides(pd):
    p, d = pd
    tid = f"t{next(_ids)}"
    rp, rd = request(), request()
    rp.lora_name, rd.lora_name = "sql", "chat"
    p.conn.add_request(rp, PDParams(tid, "prefill"))
    d.conn.add_request(rd, PDParams(tid, "decode", prefill_addr=f"127.0.0.1:{p.conn.port}"))
    p_out, d_out = pump(p, d, lambda: d.conn.phase_of(tid) is None and p.conn.phase_of(tid) is None)
    assert "LoRA adapter 'chat'" in p_out[0].error and "'sql'" in d_out[0].error
    assert p.free_blocks == p.num_blocks


def test_p_gives_up_on_cache_info_that_never_comes(pd):
    p, d = pd
    tid = "never-sent"
    rp = request()
    p.conn.add_request(rp, PDParams(tid, "prefill"))
    p.clock.now += 10 * LEASE + 1
    out = p.conn.poll()
    assert [o.request_id for o in out] == [rp.request_id] and "never sent its cache info" in out[0].error
    assert p.conn.phase_of(tid) is None


@pytest.mark.parametrize("forged", ["give up", "rdma agent"])
def test_a_forged_control_message_is_refused_and_changes_nothing(pd, forged):
    p, d = pd
    tid, rp, rd = submit(p, d)
    if forged == "give up":
        pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
        msg = PDError(tid, "forged: give up")
    else:  # cache info naming an outsider's NIXL agent: P must never add it, nor write its KV there
        layout = KVLayout(32, 2, BLOCK, 1, 16, "float32")
        msg = CacheInfo(tid, rp.num_prompt_tokens, prompt_digest(rp.prompt_token_ids), [0, 1, 2], layout,
                        [RdmaEndpoint("outsider", b"metadata", 0, layout.nbytes)], LEASE, time.time() + LEASE)
    ctx = zmq.Context.instance()
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(f"tcp://127.0.0.1:{p.conn.port}")
    forger.send(msgspec.msgpack.encode(msg))  # not sealed with the cluster secret
    pump(p, d, lambda: p.conn.stats().refused_control_messages == 1)
    forger.close()
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    assert p.conn.endpoint_of(tid) == TcpEndpoint("127.0.0.1", 1)  # D's own, never the forger's


# ---- decode side with a splitwise cache buffer (seed 002) ----------------------------------------


@pytest.fixture
def pd_buffer():
    ctx = zmq.Context()
    p, d = Side("prefill", 32, ctx), Side("decode", 4, ctx, buffer_blocks=12)  # D's cache: one request
    yield p, d
    for side in (p, d):
        side.conn.close()
        side.service.sock.close()
    ctx.term()


def finish_prefills(p: Side, d: Side, tids: list[str]) -> None:
    """P computes every prompt in one step, the messager reports every byte written, D acks."""
    pump(p, d, lambda: all(p.conn.phase_of(t) is PrefillPhase.SCHEDULED for t in tids))
    prefill_step(p)
    p.service.reports += [TransferDone(t, ok=True, nbytes=10) for t in tids]
    pump(p, d, lambda: all(p.conn.phase_of(t) is None for t in tids))  # D acked: P let go


def test_with_a_buffer_p_is_released_before_d_has_cache_blocks(pd_buffer):
    p, d = pd_buffer
    jobs = [submit(p, d) for _ in range(3)]  # 3 blocks each: all three fit the buffer, one fits D's cache
    assert d.free_blocks == d.num_blocks  # nothing taken from D's cache yet
    assert d.conn.stats().buffer.blocks_used == 9
    finish_prefills(p, d, [tid for tid, _, _ in jobs])
    assert p.free_blocks == p.num_blocks  # every prefill released while D decodes none of them
    phases = [d.conn.phase_of(tid) for tid, _, _ in jobs]
    assert phases == [DecodePhase.SWAPPING_IN, DecodePhase.BUFFERED, DecodePhase.BUFFERED]
    (tid0, src, dst), = d.service.swaps
    assert tid0 == jobs[0][0] and len(src) == len(dst) == 3
    assert dst == [b.block_id for b in jobs[0][2].blocks[:3]]  # into the request's own cache blocks

    d.service.reports.append(SwapDone(tid0, nbytes=300, seconds=0.001))
    out = d.conn.poll()
    assert [(o.request_id, o.new_token_ids) for o in out] == [(jobs[0][2].request_id, [42])]
    assert jobs[0][2] in d.scheduler.running
    buffer = d.conn.stats().buffer
    assert buffer.blocks_used == 6 and buffer.buffered_requests == 2
    assert buffer.swap_in_bytes == 300 and buffer.wait_seconds.count == 1 and buffer.swap_in_seconds.count == 1
    again = d.conn.stats().buffer  # reading takes nothing away
    assert (again.wait_seconds, again.swap_in_seconds) == (buffer.wait_seconds, buffer.swap_in_seconds)

    d.scheduler.abort(jobs[0][2].request_id)  # the first finishes decoding: the next one gets the cache
    d.conn.poll()
    assert d.conn.phase_of(jobs[1][0]) is DecodePhase.SWAPPING_IN


def test_without_a_buffer_the_same_requests_wait_on_d_and_p_cannot_start_them():
    ctx = zmq.Context()
    p, d = Side("prefill", 32, ctx), Side("decode", 4, ctx)  # the same D, no buffer
    try:
        jobs = [submit(p, d) for _ in range(3)]
        tids = [tid for tid, _, _ in jobs]
        assert [d.conn.phase_of(t) for t in tids] == [DecodePhase.PREALLOCATED, DecodePhase.QUEUED,
                                                      DecodePhase.QUEUED]
        pump(p, d, lambda: p.conn.phase_of(tids[0]) is PrefillPhase.SCHEDULED)
        assert [p.conn.phase_of(t) for t in tids[1:]] == [PrefillPhase.AWAITING_CACHE_INFO] * 2
        finish_prefills(p, d, tids[:1])
        assert [p.conn.phase_of(t) for t in tids[1:]] == [PrefillPhase.AWAITING_CACHE_INFO] * 2  # until D frees
    finally:
        for side in (p, d):
            side.conn.close()
            side.service.sock.close()
        ctx.term()


def test_aborts_in_the_buffer_free_its_blocks_and_wait_for_a_copy_in_flight(pd_buffer):
    p, d = pd_buffer
    jobs = [submit(p, d) for _ in range(2)]
    finish_prefills(p, d, [tid for tid, _, _ in jobs])
    (tid0, _, _), = d.service.swaps
    # BUFFERED: nothing writes into its buffer blocks any more; they are free at once
    assert d.conn.abort(jobs[1][2].request_id) is jobs[1][2]
    assert d.conn.stats().buffer.blocks_used == 3
    # SWAPPING_IN: the request ends now, its cache blocks only once the copy is done
    assert d.conn.abort(jobs[0][2].request_id) is jobs[0][2] and jobs[0][2].is_finished
    assert d.free_blocks == d.num_blocks - 3
    d.service.reports.append(SwapDone(tid0, nbytes=300, seconds=0.001))
    assert d.conn.poll() == []
    assert d.free_blocks == d.num_blocks and d.conn.stats().buffer.blocks_used == 0
    assert d.conn.phase_of(tid0) is None


def test_a_full_buffer_queues_and_a_dead_prefill_quarantines_buffer_blocks(pd_buffer):
    p, d = pd_buffer
    jobs = [submit(p, d, n_prompt=40) for _ in range(2)]  # 10 buffer blocks each: the second queues
    assert [d.conn.phase_of(t) for t, _, _ in jobs] == [DecodePhase.PREALLOCATED, DecodePhase.QUEUED]
    d.clock.now += LEASE + 0.1  # P never delivers the first
    d.conn.poll()
    assert d.conn.stats().quarantined_blocks == 10  # P might still be writing into them
    assert d.conn.phase_of(jobs[1][0]) is DecodePhase.QUEUED
    d.clock.now += QUARANTINE_GRACE + 0.1
    d.conn.poll()
    assert d.conn.phase_of(jobs[1][0]) is DecodePhase.PREALLOCATED  # the freed buffer took the queued one


# ---- decode-side prefix reuse ----------------------------------------------------------------------


@pytest.mark.parametrize("buffer_blocks", [0, 12], ids=["cache", "buffer"])
def test_d_asks_p_only_for_the_blocks_its_prefix_cache_lacks(buffer_blocks):
    ctx = zmq.Context()
    p, d = Side("prefill", 32, ctx), Side("decode", 8, ctx, buffer_blocks=buffer_blocks, prefix_caching=True)
    try:
        tid, rp, rd = submit(p, d)  # 10 tokens: blocks 0-1 full, block 2 partial
        finish_prefills(p, d, [tid])
        if buffer_blocks:
            (swap_tid, _, _), = d.service.swaps
            d.service.reports.append(SwapDone(swap_tid, nbytes=30, seconds=0.001))
            d.conn.poll()
        assert rd in d.scheduler.running
        first_blocks = [b.block_id for b in rd.blocks[:2]]
        d.scheduler.abort(rd.request_id)  # the first conversation turn is over: its blocks stay cached

        tid2, rp2, rd2 = submit(p, d)  # the same prompt again: D has its two full blocks
        pump(p, d, lambda: p.conn.phase_of(tid2) is PrefillPhase.SCHEDULED)
        out = p.scheduler.schedule()
        (plan,) = p.conn.transfers(out.chunks)
        assert len(plan.src_blocks) == len(plan.dst_blocks) == 1  # only the partial block goes
        if not buffer_blocks:
            assert plan.dst_blocks == [rd2.blocks[2].block_id]
        assert d.conn.stats().blocks_skipped == 2
        p.scheduler.update(out, {rp2.request_id: [42]})
        p.conn.on_prefilled(rp2, 42, None)
        p.service.reports.append(TransferDone(tid2, ok=True, nbytes=10))
        pump(p, d, lambda: p.conn.phase_of(tid2) is None)
        if buffer_blocks:
            (_, (swap_tid, src, dst)) = d.service.swaps
            assert len(src) == len(dst) == 1  # only the block P sent is copied; the cached two are D's own
            d.service.reports.append(SwapDone(swap_tid, nbytes=10, seconds=0.001))
            d.conn.poll()
        assert rd2 in d.scheduler.running and rd2.num_cached_tokens == 2 * BLOCK
        assert [b.block_id for b in rd2.blocks[:2]] == first_blocks  # the very same cached blocks
    finally:
        for side in (p, d):
            side.conn.close()
            side.service.sock.close()
        ctx.term()


# ---- layer groups: a sliding-window group gets only its window's blocks -----------------------------------------

WINDOWED = LayerGroups(((1,), (0,)), (0, 8))  # layer 1 attends to everything, layer 0 to its last 8 tokens


@contextlib.contextmanager
def windowed_pair(**decode: int | bool) -> Iterator[tuple[Side, Side]]:
    """P (8 tokens a step) and D with the WINDOWED groups; closed afterwards."""
    ctx = zmq.Context()
    p, d = (Side("prefill", 32, ctx, groups=WINDOWED, chunk=8, prefix_caching=True),
            Side("decode", 16, ctx, groups=WINDOWED, **decode))
    try:
        yield p, d
    finally:
        for side in (p, d):
            side.conn.close()
            side.service.sock.close()
        ctx.term()


def _prefill_in_chunks(p: Side, rp: Request) -> list:
    """P computes the prompt 8 tokens a step; each step's transfer plan."""
    plans = []
    while not rp.is_finished:
        out = p.scheduler.schedule()
        plans += p.conn.transfers(out.chunks)
        p.scheduler.update(out, {rp.request_id: [42]} if rp.num_computed_tokens + out.chunks[0].num_new_tokens
                           >= rp.num_prompt_tokens else {})
    p.conn.on_prefilled(rp, 42, None)
    return plans


@pytest.mark.parametrize("buffer_blocks", [0, 16], ids=["cache", "buffer"])
def test_with_layer_groups_d_takes_and_p_sends_a_sliding_group_only_its_window(buffer_blocks):
    """A 30-token prompt (8 blocks of 4) with a window of 8: D's first decode step sees tokens 23-30, so the sliding
    group needs blocks 5-7 only. D holds (or buffers) the global group's 8 and those 3; P, computing 8 tokens a
    step, plans the global group's blocks as each chunk computes them and the sliding group's from block 5 on."""
    with windowed_pair(buffer_blocks=buffer_blocks) as (p, d):
        tid, rp, rd = submit(p, d, n_prompt=30)
        if buffer_blocks:
            assert d.conn.stats().buffer.blocks_used == 8 + 3 and d.free_blocks == d.num_blocks
        else:
            assert [b is not None for b in rd.group_blocks[0]] == [False] * 5 + [True] * 3
            assert d.free_blocks == d.num_blocks - 8 - 3
        pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
        plans = _prefill_in_chunks(p, rp)
        assert [len(plan.src_blocks) for plan in plans] == [2, 2, 2, 2]  # the global group: every block
        assert [len(plan.group_pairs[0].src_blocks) for plan in plans] == [0, 0, 1, 2]  # blocks 5; 6, 7
        sliding_src = [b for plan in plans for b in plan.group_pairs[0].src_blocks]
        assert sliding_src == [b.block_id for b in rp.group_blocks[0][5:8]]  # P's own blocks of the window
        sliding_dst = [b for plan in plans for b in plan.group_pairs[0].dst_blocks]
        p.service.reports.append(TransferDone(tid, ok=True, nbytes=10))
        pump(p, d, lambda: p.conn.phase_of(tid) is None)
        if buffer_blocks:
            (_, src, dst), = d.service.swaps
            assert src[8:] == sliding_dst and len(dst) == 11
            assert dst == [b.block_id for b in rd.blocks[:8] + rd.group_blocks[0][5:8]]
            d.service.reports.append(SwapDone(tid, nbytes=10, seconds=0.001))
            d.conn.poll()
        else:
            assert sliding_dst == [b.block_id for b in rd.group_blocks[0][5:8]]
        assert rd in d.scheduler.running and rd.output_token_ids == [42]
        d.scheduler.abort(rd.request_id)
        assert d.free_blocks == d.num_blocks and p.free_blocks == p.num_blocks


def test_with_layer_groups_d_asks_only_for_what_its_prefix_cache_lacks_in_every_group():
    with windowed_pair(prefix_caching=True) as (p, d):
        tid, rp, rd = submit(p, d, n_prompt=30)
        pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
        _prefill_in_chunks(p, rp)
        p.service.reports.append(TransferDone(tid, ok=True, nbytes=10))
        pump(p, d, lambda: p.conn.phase_of(tid) is None)
        d.scheduler.abort(rd.request_id)  # the turn is over: its full blocks stay cached, in both groups

        tid2, rp2, rd2 = submit(p, d, n_prompt=30)  # 7 full blocks cached; the sliding group's 5 and 6 among them
        assert rd2.num_cached_tokens == 7 * BLOCK
        pump(p, d, lambda: p.conn.phase_of(tid2) is PrefillPhase.SCHEDULED)
        plans = _prefill_in_chunks(p, rp2)
        assert [b for plan in plans for b in plan.dst_blocks] == [rd2.blocks[7].block_id]
        assert [b for plan in plans for b in plan.group_pairs[0].dst_blocks] == [rd2.group_blocks[0][7].block_id]


def test_a_reset_while_a_buffered_request_holds_its_cached_window_keeps_those_blocks_for_it():
    """With a decode buffer D holds the prompt's cached blocks, its window's among them, until the swap-in: a prefix
    cache reset meanwhile (new weights, say) unindexes them, and the swap-in still takes the very blocks it held."""
    with windowed_pair(buffer_blocks=16, prefix_caching=True) as (p, d):
        tid, rp, rd = submit(p, d, n_prompt=30)
        finish_buffered(p, d, rp, tid)
        d.scheduler.abort(rd.request_id)  # the first turn is over: its full blocks stay cached

        tid2, rp2, rd2 = submit(p, d, n_prompt=30)
        held = [b for hits in d.conn._by_tid[tid2].window_cached for b in hits]
        assert len(held) == 2  # the sliding group's blocks 5 and 6 (7 is partial: P sends it)
        d.scheduler.kv.reset_prefix_cache()
        finish_buffered(p, d, rp2, tid2)
        assert rd2 in d.scheduler.running and rd2.group_blocks[0][5:7] == held
        d.scheduler.abort(rd2.request_id)
        assert d.free_blocks == d.num_blocks


def finish_buffered(p: Side, d: Side, rp: Request, tid: str) -> None:
    """P computes the prompt, the KV lands in D's buffer and is swapped into D's cache."""
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    _prefill_in_chunks(p, rp)
    p.service.reports.append(TransferDone(tid, ok=True, nbytes=10))
    pump(p, d, lambda: p.conn.phase_of(tid) is None)
    d.service.reports.append(SwapDone(tid, nbytes=10, seconds=0.001))
    d.conn.poll()


def test_cache_info_naming_sliding_blocks_outside_the_window_is_refused_on_both_sides(monkeypatch):
    """P drops a sliding group's blocks as the prompt moves past them: a D that asks for them gets an error."""
    with windowed_pair() as (p, d):
        monkeypatch.setattr(d.conn, "_wanted", lambda tables, r, skip: [[7] * len(t) for t in tables])
        tid, rp, rd = submit(p, d, n_prompt=30)
        p_out, d_out = pump(p, d, lambda: d.conn.phase_of(tid) is None and p.conn.phase_of(tid) is None)
        assert "layer group 1's blocks outside the window" in p_out[0].error
        assert "outside the window" in d_out[0].error
        assert p.free_blocks == p.num_blocks


def test_p_renews_the_lease_from_inside_a_step_that_outlasts_it(pd):
    """A prefill step on a slow CPU can last longer than D's lease. The engine calls during_step while
    it waits on the worker: P renews from there, D keeps its blocks, and the messager keeps writing."""
    p, d = pd
    tid, rp, rd = submit(p, d)
    pump(p, d, lambda: p.conn.phase_of(tid) is PrefillPhase.SCHEDULED)
    out = p.scheduler.schedule()
    assert len(p.conn.transfers(out.chunks)) == 1  # the step starts: the messager knows the transfer
    for _ in range(6):  # two leases go by inside the step; P's engine loop does not poll meanwhile
        p.clock.now += LEASE / 3 + 0.1
        d.clock.now += LEASE / 3 + 0.1
        p.conn.during_step()
        deadline = time.monotonic() + 5
        while d.conn._by_tid[tid].lease_deadline < d.clock.now + LEASE / 2:  # the renewal reaches D
            assert time.monotonic() < deadline, "no renewal reached D"
            assert d.conn.poll() == []
            time.sleep(0.002)
    assert d.conn.phase_of(tid) is DecodePhase.PREALLOCATED and d.free_blocks == d.num_blocks - 3
    assert [deadline for t, deadline in p.service.extended if t == tid][-1] > p.clock.now + LEASE / 2
    p.scheduler.update(out, {rp.request_id: [42]})  # the step ends: the transfer is still alive on both sides
    p.conn.on_prefilled(rp, 42, None)
    assert p.conn.poll() == [] and p.conn.phase_of(tid) is PrefillPhase.PREFILLED
