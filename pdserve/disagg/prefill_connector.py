"""The prefill side of PD (vLLM's "KV connector, scheduler half" on a prefill instance).

P listens on its control channel (--pd-comm-port). A PD request waits, holding no blocks, until
D's *cache info* names D's blocks; then it is scheduled like any other, the worker tells the
messager in the cache service which blocks go where each step, and P sends *prefill done* once the
first token is out and the messager reports every byte written. The phases and lease rules are in
lifecycle.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from pdserve.config.engine import EngineConfig
from pdserve.disagg.cache_service_client import CacheServiceClient
from pdserve.disagg.connector_base import ConnectorBase, prompt_digest
from pdserve.disagg.control_channel import PrefillControl
from pdserve.disagg.lifecycle import (
    AWAIT_INFO_LEASES,
    LEASE_MARGIN,
    PREFILL_TRANSITIONS,
    PrefillPhase,
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
    TransferDone,
)
from pdserve.engine.block_pool import Block
from pdserve.engine.messages import PDParams, RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.engine.stats import PDStats, copied
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer_plan import BlockPairs, TransferPlan
from pdserve.transport import Endpoint, choose_endpoint
from pdserve.worker.protocol import TokenLogprobs

log = logging.getLogger("pdserve.pd")
Phase = PrefillPhase


@dataclass
class Outgoing:
    """One transfer as P sees it."""

    request: Request
    transfer_id: str
    wait_deadline: float  # for cache info
    phase: Phase = Phase.AWAITING_CACHE_INFO
    identity: bytes | None = None  # D's DEALER
    endpoint: Endpoint | None = None
    dst_blocks: list[int] = field(default_factory=list)
    group_dst_blocks: list[list[int]] = field(default_factory=list)  # layer groups 1.. (CacheInfo)
    deadline: float = float("inf")  # D's lease, less the margin
    lease: float = 0.0  # D's lease length; renewed every third of it
    renewed: float = 0.0  # when the lease was last renewed (or granted)
    sent_blocks: int = 0  # leading blocks whose every layer is planned for D (survives preemption)
    skip_blocks: int = 0  # leading blocks D has already (its prefix cache): never sent
    started_writing: bool = False  # a plan went to the worker (so the messager knows this transfer)
    first_token: tuple[int, TokenLogprobs | None] | None = None
    transfer: TransferDone | None = None

    def move(self, phase: Phase) -> None:
        check_transition(PREFILL_TRANSITIONS, self.phase, phase, self.transfer_id)
        self.phase = phase


class PrefillConnector(ConnectorBase):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, layout: KVLayout, ctx: zmq.Context,
                 service: CacheServiceClient, clock: Callable[[], float] = time.time) -> None:
        super().__init__(config, scheduler, layout, clock)
        self.service = service
        self.control = PrefillControl(ctx, config.pd_host, config.pd_comm_port)
        self.port = self.control.port
        self._by_tid: dict[str, Outgoing] = {}
        self._by_rid: dict[str, Outgoing] = {}
        self._early: dict[str, tuple[bytes, CacheInfo, float]] = {}  # cache info that beat its request here
        self._given_up: dict[str, tuple[str, float]] = {}  # transfers D abandoned before their request came
        self._unheard: dict[str, tuple[str, float]] = {}  # transfers that ended here before D's cache info came

    # ---- the engine's hooks (engine/kv_connector.py) -------------------------------------------

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.control.socket, self.service.sock]

    def add_request(self, request: Request, pd: PDParams) -> list[RequestOutput]:
        if pd.transfer_id in self._by_tid:
            raise ValueError(f"PD transfer id {pd.transfer_id!r} is already in use")
        self.scheduler.check_request(request)
        if (gone := self._given_up.pop(pd.transfer_id, None)) is not None:
            return [self._fail_request(request, f"the decode instance gave up: {gone[0]}")]
        request.kv_producer = True
        # No blocks are held while waiting for D, so this wait may be long (D may be queueing).
        out = Outgoing(request, pd.transfer_id, self.clock() + AWAIT_INFO_LEASES * self.config.pd_transfer_timeout)
        self._by_tid[pd.transfer_id] = out
        self._by_rid[request.request_id] = out
        early = self._early.pop(pd.transfer_id, None)
        return self._on_cache_info(*early) if early else []

    def transfers(self, chunks: list[ScheduledChunk]) -> list[TransferPlan]:
        plans = []
        bs = self.layout.block_size
        for c in chunks:
            out = self._by_rid.get(c.request.request_id)
            if out is None:
                continue
            r = c.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + c.num_new_tokens
            # Blocks before this chunk that D has not got yet are prefix-cache hits (at the first chunk,
            # or after a preemption resumed past what was sent): they go whole, before layer 0. Blocks D
            # has in its own prefix cache never go.
            first = max(min(out.sent_blocks, start // bs), out.skip_blocks)
            last = (end - 1) // bs
            groups = [_wanted_pairs(table, dst, min(out.sent_blocks, start // bs), start // bs, last)
                      for table, dst in zip(r.group_blocks, out.group_dst_blocks, strict=True)]
            plans.append(TransferPlan(out.transfer_id, out.endpoint, [b.block_id for b in r.blocks[first:last + 1]],
                                      out.dst_blocks[first:last + 1], max(start // bs - first, 0),
                                      c.completes_known_tokens, out.deadline, groups))
            out.sent_blocks = max(out.sent_blocks, end // bs)
            out.started_writing = True
        return plans

    def on_prefilled(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        out = self._by_rid.get(request.request_id)
        if out is not None and out.phase in (Phase.SCHEDULED, Phase.KV_WRITTEN):
            out.first_token = (token, logprobs)
            out.move(Phase.PREFILLED if out.phase is Phase.SCHEDULED else Phase.DONE_SENT)
            if out.phase is Phase.DONE_SENT:
                self._send_done(out)

    def poll(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for identity, msg in self.control.receive():
            outputs += self._on_message(identity, msg)
        for report in self.service.transfer_reports():
            if isinstance(report, TransferDone):
                outputs += self._on_transfer_done(report)
        outputs += self._expire()
        return outputs

    def abort(self, request_id: str) -> Request | None:
        """The frontend aborted it. Returns the request if it was finished here and only held for the
        transfer, or never scheduled (the scheduler does not know it); running ones the engine aborts."""
        out = self._by_rid.get(request_id)
        if out is None:
            return None
        phase = out.phase
        self._send(out, PDError(out.transfer_id, "the prefill instance's request was aborted"))
        self._end(out, Phase.ABORTED, "the prefill instance's request was aborted")
        if out.request.is_finished:
            self.scheduler.free_blocks(out.request)
            return out.request
        if phase is Phase.AWAITING_CACHE_INFO:
            out.request.mark_finished("abort")
            return out.request
        return None

    @property
    def held(self) -> int:
        return len(self._by_tid)

    def next_deadline(self) -> float | None:
        return min((min(o.wait_deadline, o.deadline, o.renewed + o.lease / 3 if o.lease else o.deadline)
                    for o in self._by_tid.values()), default=None)

    def stats(self) -> PDStats:
        return copied(self.transfer_stats, refused_control_messages=self.control.refused)

    def close(self) -> None:
        self.control.close()

    def phase_of(self, transfer_id: str) -> Phase | None:
        out = self._by_tid.get(transfer_id)
        return out.phase if out is not None else None

    def endpoint_of(self, transfer_id: str) -> Endpoint | None:
        """Where the transfer's KV goes (once D's cache info has come)."""
        out = self._by_tid.get(transfer_id)
        return out.endpoint if out is not None else None

    # ---- internals ---------------------------------------------------------------------------

    def _on_message(self, identity: bytes, msg: ControlMessage) -> list[RequestOutput]:
        if isinstance(msg, CacheInfo):
            return self._on_cache_info(identity, msg, self.clock())
        out = self._by_tid.get(msg.transfer_id)
        if isinstance(msg, PrefillAck):
            if out is not None and out.phase is Phase.DONE_SENT:
                self._release(out)
        elif isinstance(msg, PDError):
            if out is not None:
                return self._drop(out, f"the decode instance gave up: {msg.error}", tell_decode=False)
            self._early.pop(msg.transfer_id, None)  # D gave up before this request reached P: refuse it later
            self._given_up[msg.transfer_id] = (msg.error, self.clock())
        return []

    def _on_cache_info(self, identity: bytes, info: CacheInfo, received: float) -> list[RequestOutput]:
        out = self._by_tid.get(info.transfer_id)
        if out is None:
            if (ended := self._unheard.pop(info.transfer_id, None)) is not None:
                self.control.send(identity, PDError(info.transfer_id, ended[0]))  # D is holding blocks for it
            else:
                self._early[info.transfer_id] = (identity, info, received)
            return []
        if out.identity is not None:
            return []  # a duplicate
        out.identity = identity
        endpoint = choose_endpoint(list(self.config.cache_transfer_protocol), info.endpoints)
        error = self._check_cache_info(out.request, info, endpoint)
        if error is None:
            out.endpoint, out.dst_blocks, out.skip_blocks = endpoint, info.dst_blocks, info.skip_blocks
            out.group_dst_blocks = info.group_dst_blocks
            # D's own clock says when it gives the blocks up; the receipt time covers clock skew between hosts.
            out.deadline = min(received + info.lease, info.lease_until) - LEASE_MARGIN
            out.lease, out.renewed = info.lease, received
            try:
                self.scheduler.add_request(out.request)
                out.move(Phase.SCHEDULED)
                return []
            except ValueError as e:
                error = str(e)
        return self._drop(out, error)

    def _check_cache_info(self, r: Request, info: CacheInfo, endpoint: Endpoint | None) -> str | None:
        if not self.layout.same_geometry(info.layout):
            return (f"the KV cache layouts differ (prefill {self.layout}, decode {info.layout}): another model or "
                    "--kv-cache-dtype?")
        if info.prompt_len != r.num_prompt_tokens or info.prompt_digest != prompt_digest(r.prompt_token_ids):
            return (f"the two instances tokenized the prompt differently ({r.num_prompt_tokens} vs "
                    f"{info.prompt_len} tokens)")
        if info.lora_name != r.lora_name:
            return (f"the decode instance decodes under LoRA adapter {info.lora_name!r}, the prefill instance "
                    f"computes the prompt under {r.lora_name!r}: its KV would not fit")
        if len(info.dst_blocks) < -(-r.num_prompt_tokens // self.layout.block_size):
            return f"the decode instance sent {len(info.dst_blocks)} blocks for a {r.num_prompt_tokens}-token prompt"
        if (error := self._check_group_blocks(r, info)) is not None:
            return error
        if endpoint is None:
            return (f"no common cache transfer protocol: prefill has {','.join(self.config.cache_transfer_protocol)}"
                    f", decode offers {','.join(e.protocol for e in info.endpoints) or 'none'}")
        return None

    def _check_group_blocks(self, r: Request, info: CacheInfo) -> str | None:
        """D names a block of each layer group per prompt block, and none that the prompt's last query cannot see
        (this instance drops those as the prompt is computed)."""
        groups = self.layout.layer_groups
        if len(info.group_dst_blocks) != (groups.num_groups - 1 if groups is not None else 0):
            return f"the decode instance sent blocks for {len(info.group_dst_blocks) + 1} layer groups"
        bs, num_blocks = self.layout.block_size, -(-r.num_prompt_tokens // self.layout.block_size)
        for g, dst in enumerate(info.group_dst_blocks, 1):
            live = groups.first_live_block(g, r.num_prompt_tokens, bs)
            if len(dst) < num_blocks or any(b != NOT_WANTED for b in dst[:live]):
                return (f"the decode instance asked for layer group {g}'s blocks outside the window of a "
                        f"{r.num_prompt_tokens}-token prompt")
        return None

    def _on_transfer_done(self, report: TransferDone) -> list[RequestOutput]:
        out = self._by_tid.get(report.transfer_id)
        if out is None or out.phase not in (Phase.SCHEDULED, Phase.PREFILLED):
            return []
        if not report.ok:
            return self._drop(out, f"sending the KV cache failed: {report.error}")
        out.transfer = report
        self.transfer_stats.bytes_sent += report.nbytes
        out.move(Phase.KV_WRITTEN if out.phase is Phase.SCHEDULED else Phase.DONE_SENT)
        if out.phase is Phase.DONE_SENT:
            self._send_done(out)
        return []

    def _send_done(self, out: Outgoing) -> None:
        assert out.first_token is not None and out.transfer is not None
        token, logprobs = out.first_token
        r, t = out.request, out.transfer
        times = {k: v for k, v in (("prefill_start", r.times.first_scheduled), ("first_layer_written", t.first_write),
                                   ("last_layer_written", t.last_write), ("first_token", r.times.first_token))
                 if v is not None}
        protocol = out.endpoint.protocol if out.endpoint is not None else "none"
        self._send(out, PrefillDone(out.transfer_id, token, logprobs, t.nbytes, times, protocol))
        self.transfer_stats.transfers_ok += 1
        by_protocol = self.transfer_stats.transfers_by_protocol
        by_protocol[protocol] = by_protocol.get(protocol, 0) + 1
        if t.first_write is not None and r.times.first_scheduled is not None:
            self.transfer_stats.transfer_seconds.observe(t.last_write - r.times.first_scheduled)

    def during_step(self) -> None:
        """A step (a long prefill on a slow CPU) may outlast D's lease: renew while it runs, or D gives
        the blocks up and the messager stops writing before the step is done."""
        self._renew_leases(self.clock())

    def _renew_leases(self, now: float) -> None:
        for out in self._by_tid.values():
            if out.phase in (Phase.SCHEDULED, Phase.PREFILLED, Phase.KV_WRITTEN) and now - out.renewed > out.lease / 3:
                # Counted from the send: D extends from receipt, so P's deadline never passes D's.
                self._send(out, LeaseRenew(out.transfer_id))
                out.renewed, out.deadline = now, now + out.lease - LEASE_MARGIN
                if out.started_writing:  # the messager may lag the worker: it must know too
                    self.service.extend_deadline(out.transfer_id, out.deadline)

    def _expire(self) -> list[RequestOutput]:
        now = self.clock()
        self._renew_leases(now)
        outputs = []
        for out in list(self._by_tid.values()):
            if out.phase is Phase.AWAITING_CACHE_INFO and now > out.wait_deadline:
                outputs += self._drop(out, "the decode instance never sent its cache info", tell_decode=False)
            elif out.phase is not Phase.AWAITING_CACHE_INFO and now > out.deadline + LEASE_MARGIN:
                if out.phase is Phase.DONE_SENT:  # D never acknowledged: it is gone; the KV is useless now
                    self._release(out)
                else:
                    outputs += self._drop(out, "the KV cache was not sent within --pd-transfer-timeout")
        for tid, (_, _, received) in list(self._early.items()):
            if now > received + AWAIT_INFO_LEASES * self.config.pd_transfer_timeout:
                del self._early[tid]
        for table in (self._given_up, self._unheard):
            for tid, (_, when) in list(table.items()):
                if now > when + AWAIT_INFO_LEASES * self.config.pd_transfer_timeout:
                    del table[tid]
        return outputs

    def _drop(self, out: Outgoing, error: str, tell_decode: bool = True) -> list[RequestOutput]:
        """End a transfer that failed: tell D, free the blocks, fail the request if it still runs here."""
        if tell_decode:
            self._send(out, PDError(out.transfer_id, error))
        self._end(out, Phase.FAILED, error)
        r = out.request
        if r.is_finished:  # its answer went out already; only the blocks are left
            self.scheduler.free_blocks(r)
            self.transfer_stats.transfers_failed += 1
            return []
        self.scheduler.abort(r.request_id)
        return [self._fail_request(r, error)]

    def _release(self, out: Outgoing) -> None:
        self._end(out, Phase.RELEASED)
        self.scheduler.free_blocks(out.request)

    def _end(self, out: Outgoing, phase: Phase, error: str | None = None) -> None:
        if out.identity is None and error is not None:  # D may still send cache info: answer it then
            self._unheard[out.transfer_id] = (error, self.clock())
        out.move(phase)
        self._by_tid.pop(out.transfer_id, None)
        self._by_rid.pop(out.request.request_id, None)

    def _send(self, out: Outgoing, msg: ControlMessage) -> None:
        if out.identity is not None:
            self.control.send(out.identity, msg)


def _wanted_pairs(table: list[Block | None], dst: list[int], first: int, computed_from: int, last: int) -> BlockPairs:
    """A layer group's blocks first..last that D wants, those before `computed_from` to be sent whole. This instance
    holds every one of them: D wants none that the prompt's last query cannot see (checked at its cache info), and
    none of those went back to the pool while the prompt was computed."""
    wanted = [i for i in range(first, last + 1) if dst[i] != NOT_WANTED]
    return BlockPairs([table[i].block_id for i in wanted], [dst[i] for i in wanted],
                      sum(i < computed_from for i in wanted))
