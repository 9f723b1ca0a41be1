"""The decode side of PD (vLLM's "KV connector, scheduler half" on a decode instance).

D reserves its own blocks for a PD request's prompt (queueing in order while blocks are short),
sends P *cache info* over the control channel, and hands the request to its scheduler on *prefill
done*, decoding from P's first token. The phases and lease rules are in lifecycle.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdserve.config import EngineConfig
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
from pdserve.disagg.messages import CacheInfo, ControlMessage, LeaseRenew, PDError, PrefillAck, PrefillDone
from pdserve.engine.block_pool import Block
from pdserve.engine.messages import PDParams, RequestOutput, TokenLogprobs
from pdserve.engine.request import Request
from pdserve.engine.request_output import final_output
from pdserve.engine.scheduler import ScheduledChunk, Scheduler
from pdserve.kv_layout import KVLayout
from pdserve.transfer_plan import TransferPlan
from pdserve.transport import Endpoint

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

    def move(self, phase: Phase) -> None:
        check_transition(DECODE_TRANSITIONS, self.phase, phase, self.transfer_id)
        self.phase = phase


class DecodeConnector(ConnectorBase):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, layout: KVLayout, ctx: zmq.Context,
                 endpoints: list[Endpoint], service: CacheServiceClient,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(config, scheduler, layout, clock)
        self.control = DecodeControl(ctx)
        self.endpoints = endpoints
        self.service = service  # runs the receivers; reports what they refused
        self._queue: deque[Incoming] = deque()  # QUEUED, in arrival order
        self._by_tid: dict[str, Incoming] = {}
        self._by_rid: dict[str, Incoming] = {}
        self._quarantine: list[tuple[float, list[Block]]] = []

    # ---- the engine's hooks (engine/kv_connector.py) -------------------------------------------

    @property
    def sockets(self) -> list[zmq.Socket]:
        return self.control.sockets

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
        self.service.transfer_reports()  # none come on D: this only takes the receivers' stats
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
        return outputs

    def abort(self, request_id: str) -> Request | None:
        inc = self._by_rid.get(request_id)
        if inc is None:
            return None  # decoding already (or never PD): an ordinary abort
        r = inc.request
        if inc.phase is Phase.PREALLOCATED:
            self._send(inc, PDError(inc.transfer_id, "the decode instance's request was aborted"))
            self._quarantine_blocks(inc)
            self.scheduler.abort(request_id)
        else:  # still queued for blocks; P has heard nothing
            self._queue.remove(inc)
            r.mark_finished("abort")
        self._end(inc, Phase.ABORTED)
        return r

    def next_deadline(self) -> float | None:
        deadlines = [i.lease_deadline for i in self._by_tid.values()] + [t for t, _ in self._quarantine]
        return min(deadlines, default=None)

    def stats_dict(self) -> dict:
        return {**self.stats.as_dict(), "pd_refused_control_messages": self.control.refused,
                "pd_queued_for_blocks": len(self._queue),
                "pd_quarantined_blocks": sum(len(b) for _, b in self._quarantine),
                "kv_refused_connections": self.service.refused_connections}

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
        elif isinstance(msg, PDError):
            return [self._give_up(inc, f"the prefill instance failed: {msg.error}", tell_prefill=False)]
        return []

    def _admit(self) -> None:
        """Preallocate for queued requests in order while blocks allow; send P their cache info.
        D's own preempted requests (back in the scheduler's queue) get freed blocks first."""
        while self._queue and not self.scheduler.has_waiting:
            inc = self._queue[0]
            if not self.scheduler.preallocate(inc.request):
                return
            self._queue.popleft()
            inc.move(Phase.PREALLOCATED)
            r = inc.request
            now = self.clock()
            r.times.preallocated = now
            inc.lease_deadline = now + self.config.pd_transfer_timeout
            info = CacheInfo(inc.transfer_id, r.num_prompt_tokens, prompt_digest(r.prompt_token_ids),
                             [b.block_id for b in r.blocks], self.layout, inc.endpoints,
                             self.config.pd_transfer_timeout, inc.lease_deadline)
            self._send(inc, info)
            r.times.cache_info_sent = self.clock()

    def _on_prefill_done(self, inc: Incoming, msg: PrefillDone) -> list[RequestOutput]:
        self._end(inc, Phase.DECODING)
        self._send(inc, PrefillAck(inc.transfer_id))
        r = inc.request
        t = r.times
        t.prefill_done_received = self.clock()
        t.first_scheduled = msg.times.get("prefill_start", t.first_scheduled)
        t.first_layer_written = msg.times.get("first_layer_written")
        t.last_layer_written = msg.times.get("last_layer_written")
        self.stats.bytes_received += msg.nbytes
        self.stats.transfers_ok += 1
        if t.cache_info_sent is not None:
            self.stats.seconds.append(t.prefill_done_received - t.cache_info_sent)
        self.scheduler.mark_prefilled(r.request_id, msg.first_token)
        out = final_output(r) if r.is_finished else RequestOutput(r.request_id, [])
        out.new_token_ids = [msg.first_token]
        out.new_logprobs = [msg.logprobs] if msg.logprobs is not None else None
        return [out]

    def _give_up(self, inc: Incoming, error: str, tell_prefill: bool = True) -> RequestOutput:
        r = inc.request
        if inc.phase is Phase.PREALLOCATED:
            if tell_prefill:
                self._send(inc, PDError(inc.transfer_id, error))
            self._quarantine_blocks(inc)
            self.scheduler.abort(r.request_id)
        else:
            self._queue.remove(inc)
            self._send(inc, PDError(inc.transfer_id, error))  # P may be waiting for cache info
        self._end(inc, Phase.GAVE_UP)
        return self._fail_request(r, error)

    def _quarantine_blocks(self, inc: Incoming) -> None:
        """Keep the blocks out of the pool until P cannot be writing into them any more."""
        blocks, inc.request.blocks = inc.request.blocks, []
        release = min(inc.lease_deadline, self.clock() + self.config.pd_transfer_timeout) + QUARANTINE_GRACE
        self._quarantine.append((release, blocks))

    def _release_quarantine(self, now: float) -> None:
        keep = []
        for release, blocks in self._quarantine:
            if now >= release:
                self.scheduler.release_blocks(blocks)
            else:
                keep.append((release, blocks))
        self._quarantine = keep

    def _end(self, inc: Incoming, phase: Phase) -> None:
        inc.move(phase)
        self._by_tid.pop(inc.transfer_id, None)
        self._by_rid.pop(inc.request.request_id, None)

    def _send(self, inc: Incoming, msg: ControlMessage) -> None:
        self.control.send(inc.prefill_addr, msg)
