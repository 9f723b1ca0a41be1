"""The decode side of PD (vLLM's "KV connector, scheduler half" on a decode instance).

D reserves blocks for a PD request's prompt (queueing in order while blocks are short), sends P
*cache info* over the control channel, and hands the request to its scheduler on *prefill done*,
decoding from P's first token. The blocks are D's own cache blocks, or with
--splitwise-cache-buffer-size (seed 002) blocks of a host buffer in the cache service: then P is
released as soon as its KV is complete, and D takes cache blocks only when the request can join
the decode batch, after the cache service has copied buffer -> cache. With the cache in device memory
P writes into the cache service's staging area (the cache's block ids) or the buffer, and
the worker copies host -> device with its next step, before that step's forward pass (WorkerCopies).
The phases and lease rules are in lifecycle.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from pdserve.config.engine import EngineConfig
from pdserve.disagg.cache_service_client import CacheServiceClient
from pdserve.disagg.connector_base import ConnectorBase, prompt_digest
from pdserve.disagg.control_channel import DecodeControl
from pdserve.disagg.lifecycle import (
    DECODE_TRANSITIONS,
    QUARANTINE_GRACE,
    QUEUE_TIMEOUT_LEASES,
    DecodePhase,
    check_transition,
)
from pdserve.disagg.messages import (
    NOT_WANTED,
    CacheInfo,
    ControlMessage,
    LeaseRenew,
    PDError,
    PrefillAck,
    PrefillDone,
    SwapDone,
)
from pdserve.engine.block_copies import BlockCopies, ServiceCopies
from pdserve.engine.block_pool import Block, BlockPool
from pdserve.engine.messages import PDParams, RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.request_output import final_output
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.engine.stats import DecodeBufferStats, PDStats, copied
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer_plan import TransferPlan
from pdserve.transport import Endpoint
from pdserve.worker.protocol import TokenLogprobs

Phase = DecodePhase


@dataclass
class Incoming:
    """One transfer as D sees it."""

    request: Request
    transfer_id: str
    prefill_addr: str
    queue_deadline: float  # D gives up waiting for free blocks (and tells P) at this time
    endpoints: list[Endpoint]  # what P may write through (the router may have chosen one)
    phase: Phase = Phase.QUEUED
    lease_deadline: float = float("inf")
    buffer: list[Block] = field(default_factory=list)  # buffer blocks (with a splitwise cache buffer)
    cached: list[Block] = field(default_factory=list)  # with a buffer: the prompt's blocks in D's prefix cache
    window_cached: list[list[Block]] = field(default_factory=list)  # and each sliding-window group's (layer groups)
    done: PrefillDone | None = None  # P's message, kept while the KV waits in the buffer
    held: list[Block] = field(default_factory=list)  # aborted while swapping in: its cache blocks, till copied

    def move(self, phase: Phase) -> None:
        check_transition(DECODE_TRANSITIONS, self.phase, phase, self.transfer_id)
        self.phase = phase


class DecodeConnector(ConnectorBase):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, layout: KVLayout, ctx: zmq.Context,
                 endpoints: list[Endpoint], service: CacheServiceClient,
                 clock: Callable[[], float] = time.time, buffer_blocks: int = 0,
                 copies: BlockCopies | None = None) -> None:
        super().__init__(config, scheduler, layout, clock)
        self.copies = copies or ServiceCopies(service)  # who swaps the buffer in (and copies staged KV in)
        self.buffer = BlockPool(buffer_blocks, enable_caching=False) if buffer_blocks else None
        self._buffered: deque[Incoming] = deque()  # BUFFERED, in the order their KV completed
        self.buffer_stats = DecodeBufferStats()
        self.control = DecodeControl(ctx)
        self.endpoints = endpoints
        self.service = service  # runs the receivers; reports what they refused
        self._queue: deque[Incoming] = deque()  # QUEUED, in arrival order
        self._by_tid: dict[str, Incoming] = {}
        self._by_rid: dict[str, Incoming] = {}
        self._quarantine: list[tuple[float, list[Block], BlockPool | None]] = []  # None: the cache's pool

    # ---- the engine's hooks (engine/kv_connector.py) -------------------------------------------

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [*self.control.sockets, self.service.sock]

    def add_request(self, request: Request, pd: PDParams) -> list[RequestOutput]:
        if not pd.prefill_addr:
            raise ValueError("a PD decode request needs the prefill instance's address (pd.prefill_addr)")
        if pd.transfer_id in self._by_tid:
            raise ValueError(f"PD transfer id {pd.transfer_id!r} is already in use")
        self.scheduler.check_request(request)
        endpoints = [e for e in self.endpoints if pd.transport in (None, e.protocol)]
        if not endpoints:
            raise ValueError(f"this decode instance does not offer the {pd.transport} cache transfer protocol "
                             f"(it offers {','.join(e.protocol for e in self.endpoints)})")
        inc = Incoming(request, pd.transfer_id, pd.prefill_addr,
                       queue_deadline=self.clock() + QUEUE_TIMEOUT_LEASES * self.config.pd_transfer_timeout,
                       endpoints=endpoints)
        self._by_tid[pd.transfer_id] = inc
        self._by_rid[request.request_id] = inc
        self._queue.append(inc)
        self._admit()
        return []

    def transfers(self, chunks: list[ScheduledChunk]) -> list[TransferPlan]:
        return []

    def on_prefilled(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        pass  # D never produces KV

    def poll(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for report in self.service.transfer_reports():  # also takes the receivers' stats
            if isinstance(report, SwapDone):
                outputs += self._on_swapped_in(report)
        for transfer_id, nbytes, seconds in self.copies.swaps_done():  # those the worker ran
            outputs += self._on_swapped_in(SwapDone(transfer_id, nbytes, seconds))
        for _addr, msg in self.control.receive():
            outputs += self._on_message(msg)
        now = self.clock()
        for inc in [i for i in self._by_tid.values() if i.phase is Phase.PREALLOCATED and now > i.lease_deadline]:
            outputs.append(self._give_up(inc, f"the prefill instance at {inc.prefill_addr} did not deliver the KV "
                                              f"cache within {self.config.pd_transfer_timeout:g} s "
                                              "(--pd-transfer-timeout)"))
        for inc in [i for i in self._queue if now > i.queue_deadline]:
            outputs.append(self._give_up(inc, "the decode instance had no free KV blocks for "
                                              f"{now - inc.request.times.arrival:.0f} s"))
        self._release_quarantine(now)
        self._admit()
        self._swap_in()
        return outputs

    def abort(self, request_id: str) -> Request | None:
        inc = self._by_rid.get(request_id)
        if inc is None:
            return None  # decoding already (or never PD): an ordinary abort
        r = inc.request
        if inc.phase is Phase.PREALLOCATED:
            self._send(inc, PDError(inc.transfer_id, "the decode instance's request was aborted"))
            self._quarantine_blocks(inc)
            if self.scheduler.abort(request_id) is None:  # its blocks were the buffer's
                r.mark_finished("abort")
        elif inc.phase is Phase.BUFFERED:  # P is done writing: the buffer blocks are free at once
            self._buffered.remove(inc)
            self.buffer.free(inc.buffer)
            self._drop_cached(inc)
            r.mark_finished("abort")
        elif inc.phase is Phase.SWAPPING_IN:  # the copy is in flight: its blocks go when it is done
            self._hold_until_swapped(inc)
            self.scheduler.abort(request_id)
        else:  # still queued for blocks; P has heard nothing
            self._queue.remove(inc)
            r.mark_finished("abort")
        if inc.phase is not Phase.SWAPPING_IN:  # that one ends when its copy is done
            self._end(inc, Phase.ABORTED)
        return r

    @property
    def held(self) -> int:
        return len(self._by_tid)

    def next_deadline(self) -> float | None:
        first = self._buffered[0] if self._buffered else None
        if first is not None and self.scheduler.can_preallocate(first.request, first.cached, first.window_cached):
            return self.clock()  # KV waiting for cache blocks that a finished step has just freed: at once
        deadlines = [i.lease_deadline for i in self._by_tid.values() if i.phase is Phase.PREALLOCATED]
        deadlines += [t for t, _, _ in self._quarantine] + [i.queue_deadline for i in self._queue]
        return min(deadlines, default=None)

    def stats(self) -> PDStats:
        return copied(self.transfer_stats, refused_control_messages=self.control.refused,
                      queued_for_blocks=len(self._queue),
                      quarantined_blocks=sum(len(b) for _, b, _ in self._quarantine),
                      refused_connections=self.service.refused_connections, buffer=self._buffer_stats())

    def _buffer_stats(self) -> DecodeBufferStats | None:
        if self.buffer is None:
            return None
        buffered = sum(i.phase in (Phase.BUFFERED, Phase.SWAPPING_IN) for i in self._by_tid.values())
        return copied(self.buffer_stats, blocks=self.buffer.num_blocks,
                      blocks_used=self.buffer.num_blocks - self.buffer.num_free_blocks, buffered_requests=buffered)

    def close(self) -> None:
        self.control.close()

    def phase_of(self, transfer_id: str) -> Phase | None:
        inc = self._by_tid.get(transfer_id)
        return inc.phase if inc is not None else None

    # ---- internals ---------------------------------------------------------------------------

    def _on_message(self, msg: ControlMessage) -> list[RequestOutput]:
        inc = self._by_tid.get(msg.transfer_id)
        if inc is None:
            return []  # late: the lease ended or the request was aborted
        if isinstance(msg, PrefillDone) and inc.phase is Phase.PREALLOCATED:
            return self._on_prefill_done(inc, msg)
        if isinstance(msg, LeaseRenew) and inc.phase is Phase.PREALLOCATED:
            inc.lease_deadline = self.clock() + self.config.pd_transfer_timeout
        elif isinstance(msg, PDError) and inc.phase in (Phase.QUEUED, Phase.PREALLOCATED):
            return [self._give_up(inc, f"the prefill instance failed: {msg.error}", tell_prefill=False)]
        return []

    def _admit(self) -> None:
        """Preallocate for queued requests in order while blocks allow; send P their cache info.
        D's own preempted requests (back in the scheduler's queue) get freed blocks first."""
        while self._queue:
            inc = self._queue[0]
            if not self._reserve(inc):
                return
            self._queue.popleft()
            inc.move(Phase.PREALLOCATED)
            r = inc.request
            now = self.clock()
            r.times.preallocated = now
            inc.lease_deadline = now + self.config.pd_transfer_timeout
            # Entries before skip_blocks name D's cached blocks; P never writes them.
            skip = len(inc.cached) if self.buffer is not None else r.num_cached_tokens // self.layout.block_size
            tables = self._buffer_tables(inc) if self.buffer is not None else [r.blocks, *r.group_blocks]
            ids = [[NOT_WANTED if b is None else b.block_id for b in table] for table in tables]
            self.transfer_stats.blocks_skipped += skip
            info = CacheInfo(inc.transfer_id, r.num_prompt_tokens, prompt_digest(r.prompt_token_ids),
                             ids[0], self.layout, inc.endpoints, self.config.pd_transfer_timeout,
                             inc.lease_deadline, skip, r.lora_name, self._wanted(ids[1:], r, skip))
            self._send(inc, info)
            r.times.cache_info_sent = self.clock()

    def _reserve(self, inc: Incoming) -> bool:
        """Blocks for the prompt: the buffer's, or (D's own preempted requests going first) the cache's.
        The prompt's leading blocks in D's own prefix cache are taken as they are; P will not send them."""
        cached = self.scheduler.cached_prefix(inc.request)
        if cached is None:  # D's disk tier or a peer is filling its host tier: asked again on a later poll
            return False
        if self.buffer is None:
            return not self.scheduler.has_waiting and self.scheduler.preallocate(inc.request, cached)
        need = sum(map(len, self._received(inc.request, len(cached))))
        if self.buffer.num_free_blocks < need:
            return False
        inc.buffer = self.buffer.allocate(need)
        inc.window_cached = self.scheduler.window_hits(inc.request, cached)
        self.scheduler.hold_blocks(cached + _flat(inc.window_cached))  # until the swap-in takes them for the request
        inc.cached = cached
        return True

    def _received(self, r: Request, skip: int) -> list[range]:
        """Per layer group, the prompt's blocks P writes: not the `skip` cached ones, nor in a sliding-window group
        those that the first decode step cannot see."""
        bs, groups = self.layout.block_size, self.layout.layer_groups
        n = -(-r.num_prompt_tokens // bs)
        if groups is None:
            return [range(skip, n)]
        return [range(max(groups.first_live_block(g, r.num_prompt_tokens, bs), skip), n)
                for g in range(groups.num_groups)]

    def _wanted(self, tables: list[list[int]], r: Request, skip: int) -> list[list[int]]:
        """The sliding-window groups' tables as CacheInfo names them: NOT_WANTED but where P writes."""
        return [[b if i in rng else NOT_WANTED for i, b in enumerate(table)]
                for table, rng in zip(tables, self._received(r, skip)[1:], strict=True)]

    def _buffer_tables(self, inc: Incoming) -> list[list[Block | None]]:
        """Per layer group, the blocks P writes into: the cached prefix, then buffer blocks in the order
        _reserve took them (group after group)."""
        tables, buffer = [], iter(inc.buffer)
        for g, rng in enumerate(self._received(inc.request, len(inc.cached))):
            head = inc.cached[:rng.start] if g == 0 else [None] * rng.start
            tables.append(head + [next(buffer) for _ in rng])
        return tables

    def _cache_blocks(self, r: Request, skip: int) -> list[Block]:
        """The request's cache blocks P's KV goes into, group after group (as _buffer_tables orders the buffer's)."""
        tables = [r.blocks, *r.group_blocks]
        return [tables[g][i] for g, rng in enumerate(self._received(r, skip)) for i in rng]

    def _drop_cached(self, inc: Incoming) -> None:
        self.scheduler.release_blocks(inc.cached + _flat(inc.window_cached))
        inc.cached, inc.window_cached = [], []

    def _on_prefill_done(self, inc: Incoming, msg: PrefillDone) -> list[RequestOutput]:
        self._send(inc, PrefillAck(inc.transfer_id))
        r = inc.request
        t = r.times
        t.prefill_done_received = self.clock()
        t.first_scheduled = msg.times.get("prefill_start", t.first_scheduled)
        t.first_layer_written = msg.times.get("first_layer_written")
        t.last_layer_written = msg.times.get("last_layer_written")
        t.kv_bytes, t.kv_protocol = msg.nbytes, msg.protocol
        self.transfer_stats.bytes_received += msg.nbytes
        self.transfer_stats.transfers_ok += 1
        if t.cache_info_sent is not None:
            self.transfer_stats.transfer_seconds.observe(t.prefill_done_received - t.cache_info_sent)
        if self.buffer is not None:
            inc.move(Phase.BUFFERED)
            inc.done = msg
            t.buffered = t.prefill_done_received
            self._buffered.append(inc)
            self._swap_in()
            return []
        skip = r.num_cached_tokens // self.layout.block_size
        self.copies.stage_in([b.block_id for b in self._cache_blocks(r, skip)])  # a device cache: staging -> cache
        self._end(inc, Phase.DECODING)
        return self._start_decoding(inc, msg)

    def _start_decoding(self, inc: Incoming, msg: PrefillDone) -> list[RequestOutput]:
        r = inc.request
        self.scheduler.mark_prefilled(r.request_id, msg.first_token)
        out = final_output(r) if r.is_finished else RequestOutput(r.request_id, [])
        out.new_token_ids = [msg.first_token]
        out.new_logprobs = [msg.logprobs] if msg.logprobs is not None else None
        return [out]

    def _swap_in(self) -> None:
        """Buffered requests in order take cache blocks while they are free (D's own preempted requests
        first), and the cache service copies their KV over."""
        while self._buffered and not self.scheduler.has_waiting:
            inc = self._buffered[0]
            if not self.scheduler.preallocate(inc.request, inc.cached, inc.window_cached):
                return
            self._drop_cached(inc)  # the request holds them now
            self._buffered.popleft()
            inc.move(Phase.SWAPPING_IN)
            r = inc.request
            r.times.swap_started = self.clock()
            if r.times.buffered is not None:
                self.buffer_stats.wait_seconds.observe(r.times.swap_started - r.times.buffered)
            skip = r.num_cached_tokens // self.layout.block_size
            self.copies.swap_in(inc.transfer_id, [b.block_id for b in inc.buffer],
                                [b.block_id for b in self._cache_blocks(r, skip)])

    def _on_swapped_in(self, report: SwapDone) -> list[RequestOutput]:
        inc = self._by_tid.get(report.transfer_id)
        if inc is None or inc.phase is not Phase.SWAPPING_IN:
            return []
        self.buffer.free(inc.buffer)
        self.buffer_stats.swap_in_bytes += report.nbytes
        self.buffer_stats.swap_in_seconds.observe(report.seconds)
        if inc.request.is_finished:  # aborted while the copy ran; now its blocks can go
            self._release_held(inc)
            self._end(inc, Phase.ABORTED)
            return []
        inc.request.times.swapped_in = self.clock()
        self._end(inc, Phase.DECODING)
        assert inc.done is not None
        return self._start_decoding(inc, inc.done)

    def _hold_until_swapped(self, inc: Incoming) -> None:
        """The copy into these cache blocks is in flight: take them off the request so an abort does
        not free them under it."""
        inc.held = _take_blocks(inc.request)

    def _release_held(self, inc: Incoming) -> None:
        self.scheduler.release_blocks(inc.held)
        inc.held = []

    def _give_up(self, inc: Incoming, error: str, tell_prefill: bool = True) -> RequestOutput:
        r = inc.request
        if inc.phase is Phase.PREALLOCATED:
            if tell_prefill:
                self._send(inc, PDError(inc.transfer_id, error))
            self._quarantine_blocks(inc)
            if self.scheduler.abort(r.request_id) is None:  # its blocks were the buffer's
                r.mark_finished("error")
        else:
            self._queue.remove(inc)
            self._send(inc, PDError(inc.transfer_id, error))  # P may be waiting for cache info
        self._end(inc, Phase.GAVE_UP)
        return self._fail_request(r, error)

    def _quarantine_blocks(self, inc: Incoming) -> None:
        """Keep the blocks P may write into out of their pool until P cannot be writing any more."""
        release = min(inc.lease_deadline, self.clock() + self.config.pd_transfer_timeout) + QUARANTINE_GRACE
        if self.buffer is not None:
            blocks, inc.buffer = inc.buffer, []
            self._quarantine.append((release, blocks, self.buffer))
            self._drop_cached(inc)  # P never writes D's cached blocks
        else:
            self._quarantine.append((release, _take_blocks(inc.request), None))

    def _release_quarantine(self, now: float) -> None:
        keep = []
        for release, blocks, pool in self._quarantine:
            if now < release:
                keep.append((release, blocks, pool))
            elif pool is None:
                self.scheduler.release_blocks(blocks)
            else:
                pool.free(reversed(blocks))
        self._quarantine = keep

    def _end(self, inc: Incoming, phase: Phase) -> None:
        inc.move(phase)
        self._by_tid.pop(inc.transfer_id, None)
        self._by_rid.pop(inc.request.request_id, None)

    def _send(self, inc: Incoming, msg: ControlMessage) -> None:
        self.control.send(inc.prefill_addr, msg)


def _take_blocks(request: Request) -> list[Block]:
    """Every block the request holds, in every layer group, taken off it (for the caller to free later)."""
    blocks = request.blocks + [b for table in request.group_blocks for b in table if b is not None]
    request.blocks, request.group_blocks = [], []
    return blocks


def _flat(tables: list[list[Block]]) -> list[Block]:
    return [b for table in tables for b in table]
