"""The engine side of PD: the control plane and the leases (vLLM's "KV connector, scheduler half").

A decode engine (DecodeConnector) preallocates its own blocks for a PD request, sends the prefill
engine *cache info* over a DEALER socket, and starts decoding on *prefill done*. A prefill engine
(PrefillConnector) listens on a ROUTER socket (--pd-comm-port), schedules the prompt once cache info
has come, tells its worker which blocks go where each step (the messager in the cache service does
the writing), and sends *prefill done* only after the messager reports every byte written.

Leases: D gives its blocks up if *prefill done* has not come within --pd-transfer-timeout; P stops
writing a little before D's lease ends. Blocks D gives up after a failure stay quarantined until
P can no longer be writing into them, so a late write never lands in another request's blocks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from pdserve.cluster_auth import AuthError, ControlSeal, cluster_secret
from pdserve.config import EngineConfig
from pdserve.disagg.cache_service_client import CacheServiceClient
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.messages import (
    CacheInfo,
    ControlMessage,
    LeaseRenew,
    PDError,
    PrefillAck,
    PrefillDone,
    TransferDone,
    TransferPlan,
)
from pdserve.disagg.transport import Endpoint, choose_endpoint
from pdserve.engine.block_pool import Block
from pdserve.engine.messages import PDParams, RequestOutput, TokenLogprobs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.request_output import error_output, final_output
from pdserve.engine.scheduler import ScheduledChunk, Scheduler

log = logging.getLogger("pdserve.pd")

LEASE_MARGIN = 1.0  # P stops writing this long before D's lease ends (covers message transit)
QUARANTINE_GRACE = 1.0  # D reuses given-up blocks this long after its lease ended (covers a write in flight)
QUEUE_TIMEOUT_LEASES = 5  # D waits at most this many --pd-transfer-timeout for free blocks
AWAIT_INFO_LEASES = 10  # P waits at most this many for cache info (D gives up first and says so)


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:16]


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    by_protocol: dict[str, int] = field(default_factory=dict)  # prefill side: completed transfers per transport
    seconds: list[float] = field(default_factory=list)  # per finished transfer, drained by the stats call

    def as_dict(self) -> dict:
        out = {"kv_bytes_sent": self.bytes_sent, "kv_bytes_received": self.bytes_received,
               "kv_transfers_ok": self.transfers_ok, "kv_transfers_failed": self.transfers_failed,
               "kv_transfer_seconds": self.seconds, "kv_transfers_by_protocol": dict(self.by_protocol)}
        self.seconds = []
        return out


class _Connector:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, layout: KVLayout) -> None:
        self.config = config
        self.scheduler = scheduler
        self.layout = layout
        self.stats = TransferStats()
        self.on_abort: Callable[[Request], None] = lambda request: None  # the engine drops worker state here
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)
        self._seal = ControlSeal(cluster_secret())
        self.refused_messages = 0  # forged, replayed or undecodable control messages

    def stats_dict(self) -> dict:
        return {**self.stats.as_dict(), "pd_refused_control_messages": self.refused_messages}

    def _encode(self, msg: object) -> bytes:
        return self._seal.seal(self._encoder.encode(msg))

    def _decode(self, raw: bytes, source: str) -> ControlMessage | None:
        """The message, or None (logged and counted) if it is not a genuine one from a cluster member."""
        try:
            return self._decoder.decode(self._seal.open(raw))
        except AuthError as e:
            log.warning("refused a control message from %s: %s", source, e)
        except msgspec.DecodeError:
            log.warning("dropped an undecodable control message from %s", source)
        self.refused_messages += 1
        return None

    def _fail_request(self, request: Request, error: str) -> RequestOutput:
        self.stats.transfers_failed += 1
        log.warning("request %s: %s", request.request_id, error)
        return error_output(request, f"PD error: {error}")


# ---- prefill side ----------------------------------------------------------------------------


@dataclass
class _Outgoing:
    request: Request
    transfer_id: str
    wait_deadline: float  # for cache info
    identity: bytes | None = None  # D's DEALER
    endpoint: Endpoint | None = None
    dst_blocks: list[int] = field(default_factory=list)
    deadline: float = float("inf")  # D's lease, less the margin
    lease: float = 0.0  # D's lease length; renewed every third of it
    renewed: float = 0.0  # when the lease was last renewed (or granted)
    sent_blocks: int = 0  # leading blocks whose every layer is planned for D (survives preemption)
    started_writing: bool = False  # a plan went to the worker (so the messager knows this transfer)
    first_token: tuple[int, TokenLogprobs | None] | None = None
    transfer: TransferDone | None = None
    done_sent: bool = False


class PrefillConnector(_Connector):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, layout: KVLayout, ctx: zmq.Context,
                 service: CacheServiceClient) -> None:
        super().__init__(config, scheduler, layout)
        self.service = service
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{config.pd_host}"
        if config.pd_comm_port:
            self.router.bind(f"{address}:{config.pd_comm_port}")
            self.port = config.pd_comm_port
        else:
            self.port = self.router.bind_to_random_port(address)
        self._by_tid: dict[str, _Outgoing] = {}
        self._by_rid: dict[str, _Outgoing] = {}
        self._early: dict[str, tuple[bytes, CacheInfo, float]] = {}  # cache info that beat its request here
        self._given_up: dict[str, tuple[str, float]] = {}  # transfers D abandoned before their request came

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.router, self.service.sock]

    def add_request(self, request: Request, pd: PDParams) -> list[RequestOutput]:
        if pd.transfer_id in self._by_tid:
            raise ValueError(f"PD transfer id {pd.transfer_id!r} is already in use")
        self.scheduler._check_length(request)
        if (gone := self._given_up.pop(pd.transfer_id, None)) is not None:
            return [self._fail_request(request, f"the decode instance gave up: {gone[0]}")]
        request.kv_producer = True
        # No blocks are held while waiting for D, so this wait may be long (D may be queueing).
        out = _Outgoing(request, pd.transfer_id, time.time() + AWAIT_INFO_LEASES * self.config.pd_transfer_timeout)
        self._by_tid[pd.transfer_id] = out
        self._by_rid[request.request_id] = out
        early = self._early.pop(pd.transfer_id, None)
        return self._on_cache_info(early[0], early[1], early[2]) if early else []

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
            # or after a preemption resumed past what was sent): they go whole, before layer 0.
            first = min(out.sent_blocks, start // bs)
            last = (end - 1) // bs
            plans.append(TransferPlan(out.transfer_id, out.endpoint, [b.block_id for b in r.blocks[first:last + 1]],
                                      out.dst_blocks[first:last + 1], start // bs - first,
                                      c.completes_known_tokens, out.deadline))
            out.sent_blocks = max(out.sent_blocks, end // bs)
            out.started_writing = True
        return plans

    def on_prefilled(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        out = self._by_rid.get(request.request_id)
        if out is not None:
            out.first_token = (token, logprobs)
            self._maybe_done(out)

    def poll(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:  # a peer's DEALER sends one frame; anything else is not ours
                self.refused_messages += 1
                log.warning("refused a control message of %d frames", len(frames))
                continue
            identity, raw = frames
            if (msg := self._decode(raw, f"peer {identity[:40]!r}")) is None:
                continue
            if isinstance(msg, CacheInfo):
                outputs += self._on_cache_info(identity, msg, time.time())
            elif isinstance(msg, PrefillAck):
                if (out := self._by_tid.get(msg.transfer_id)) is not None and out.done_sent:
                    self._release(out)
            elif isinstance(msg, PDError):
                if (out := self._by_tid.get(msg.transfer_id)) is not None:
                    outputs += self._drop(out, f"the decode instance gave up: {msg.error}", tell_decode=False)
                else:  # D gave up before this request reached P: refuse it when it comes
                    self._early.pop(msg.transfer_id, None)
                    self._given_up[msg.transfer_id] = (msg.error, time.time())
        for report in self.service.transfer_reports():
            outputs += self._on_transfer_done(report)
        outputs += self._expire()
        return outputs

    def abort(self, request_id: str) -> Request | None:
        """The frontend aborted it. Returns the request if it was finished here and only held for the
        transfer (the scheduler no longer knows it); running ones the engine aborts as usual."""
        out = self._by_rid.get(request_id)
        if out is None:
            return None
        self._send(out, PDError(out.transfer_id, "the prefill instance's request was aborted"))
        self._forget(out)
        if out.request.is_finished:
            self.scheduler.kv.free(out.request)
            return out.request
        if out.request.request_id not in self.scheduler.requests:  # still waiting for cache info
            out.request.status = RequestStatus.FINISHED
            out.request.finish_reason = "abort"
            return out.request
        return None

    def next_deadline(self) -> float | None:
        return min((min(o.wait_deadline, o.deadline, o.renewed + o.lease / 3 if o.lease else o.deadline)
                    for o in self._by_tid.values()), default=None)

    def close(self) -> None:
        self.router.close()

    # ---- internals ---------------------------------------------------------------------------

    def _on_cache_info(self, identity: bytes, info: CacheInfo, received: float) -> list[RequestOutput]:
        out = self._by_tid.get(info.transfer_id)
        if out is None:
            self._early[info.transfer_id] = (identity, info, received)
            return []
        if out.identity is not None:
            return []  # a duplicate
        out.identity = identity
        r = out.request
        bs = self.layout.block_size
        error = None
        endpoint = choose_endpoint(list(self.config.cache_transfer_protocol), info.endpoints)
        if not self.layout.same_geometry(info.layout):
            error = f"the KV cache layouts differ (prefill {self.layout}, decode {info.layout}): not the same model?"
        elif info.prompt_len != r.num_prompt_tokens or info.prompt_digest != prompt_digest(r.prompt_token_ids):
            error = (f"the two instances tokenized the prompt differently ({r.num_prompt_tokens} vs "
                     f"{info.prompt_len} tokens)")
        elif len(info.dst_blocks) < -(-r.num_prompt_tokens // bs):
            error = f"the decode instance sent {len(info.dst_blocks)} blocks for a {r.num_prompt_tokens}-token prompt"
        elif endpoint is None:
            error = (f"no common cache transfer protocol: prefill has {','.join(self.config.cache_transfer_protocol)}"
                     f", decode offers {','.join(e.protocol for e in info.endpoints) or 'none'}")
        if error is None:
            out.endpoint, out.dst_blocks = endpoint, info.dst_blocks
            # D's own clock says when it gives the blocks up; the receipt time covers clock skew between hosts.
            out.deadline = min(received + info.lease, info.lease_until) - LEASE_MARGIN
            out.lease, out.renewed = info.lease, received
            try:
                self.scheduler.add_request(r)
                return []
            except ValueError as e:
                error = str(e)
        return self._drop(out, error)

    def _on_transfer_done(self, report: TransferDone) -> list[RequestOutput]:
        out = self._by_tid.get(report.transfer_id)
        if out is None:
            return []
        if not report.ok:
            return self._drop(out, f"sending the KV cache failed: {report.error}")
        out.transfer = report
        self.stats.bytes_sent += report.nbytes
        self._maybe_done(out)
        return []

    def _maybe_done(self, out: _Outgoing) -> None:
        if out.first_token is None or out.transfer is None or out.done_sent:
            return
        token, logprobs = out.first_token
        r, t = out.request, out.transfer
        times = {k: v for k, v in (("prefill_start", r.times.first_scheduled), ("first_layer_written", t.first_write),
                                   ("last_layer_written", t.last_write), ("first_token", r.times.first_token))
                 if v is not None}
        self._send(out, PrefillDone(out.transfer_id, token, logprobs, t.nbytes, times))
        out.done_sent = True
        self.stats.transfers_ok += 1
        protocol = out.endpoint.protocol if out.endpoint is not None else "none"
        self.stats.by_protocol[protocol] = self.stats.by_protocol.get(protocol, 0) + 1
        if t.first_write is not None and r.times.first_scheduled is not None:
            self.stats.seconds.append(t.last_write - r.times.first_scheduled)

    def _expire(self) -> list[RequestOutput]:
        now = time.time()
        outputs = []
        for out in self._by_tid.values():
            if out.identity is not None and not out.done_sent and now - out.renewed > out.lease / 3:
                # Counted from the send: D extends from receipt, so P's deadline never passes D's.
                self._send(out, LeaseRenew(out.transfer_id))
                out.renewed, out.deadline = now, now + out.lease - LEASE_MARGIN
                if out.started_writing:  # the messager may lag the worker: it must know too
                    self.service.extend_deadline(out.transfer_id, out.deadline)
        for out in list(self._by_tid.values()):
            if out.identity is None and now > out.wait_deadline:
                outputs += self._drop(out, "the decode instance never sent its cache info", tell_decode=False)
            elif out.identity is not None and now > out.deadline + LEASE_MARGIN:
                if out.done_sent:  # D never acknowledged: it is gone; the KV is useless now
                    self._release(out)
                else:
                    outputs += self._drop(out, "the KV cache was not sent within --pd-transfer-timeout")
        for tid, (_, _, received) in list(self._early.items()):
            if now > received + AWAIT_INFO_LEASES * self.config.pd_transfer_timeout:
                del self._early[tid]
        for tid, (_, when) in list(self._given_up.items()):
            if now > when + AWAIT_INFO_LEASES * self.config.pd_transfer_timeout:
                del self._given_up[tid]
        return outputs

    def _drop(self, out: _Outgoing, error: str, tell_decode: bool = True) -> list[RequestOutput]:
        """End a transfer that failed: tell D, free the blocks, fail the request if it still runs here."""
        if tell_decode:
            self._send(out, PDError(out.transfer_id, error))
        self._forget(out)
        r = out.request
        if r.is_finished:  # its answer went out already; only the blocks are left
            self.scheduler.kv.free(r)
            self.stats.transfers_failed += 1
            return []
        self.scheduler.abort(r.request_id)
        self.on_abort(r)
        return [self._fail_request(r, error)]

    def _release(self, out: _Outgoing) -> None:
        self._forget(out)
        self.scheduler.kv.free(out.request)

    def _forget(self, out: _Outgoing) -> None:
        self._by_tid.pop(out.transfer_id, None)
        self._by_rid.pop(out.request.request_id, None)

    def _send(self, out: _Outgoing, msg: object) -> None:
        if out.identity is not None:
            try:
                self.router.send_multipart([out.identity, self._encode(msg)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # D is gone; its lease frees its side


# ---- decode side -----------------------------------------------------------------------------


@dataclass
class _Incoming:
    request: Request
    transfer_id: str
    prefill_addr: str
    queue_deadline: float  # D gives up waiting for free blocks (and tells P) at this time
    endpoints: list[Endpoint]  # what P may write through (the router may have chosen one)
    lease_deadline: float = float("inf")


class DecodeConnector(_Connector):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, layout: KVLayout, ctx: zmq.Context,
                 endpoints: list[Endpoint], service: CacheServiceClient) -> None:
        super().__init__(config, scheduler, layout)
        self.ctx = ctx
        self.endpoints = endpoints
        self.service = service  # runs the receivers; reports what they refused
        self._dealers: dict[str, zmq.Socket] = {}
        self._queue: deque[_Incoming] = deque()  # waiting for free blocks
        self._by_tid: dict[str, _Incoming] = {}
        self._by_rid: dict[str, _Incoming] = {}
        self._quarantine: list[tuple[float, list[Block]]] = []

    @property
    def sockets(self) -> list[zmq.Socket]:
        return list(self._dealers.values())

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def add_request(self, request: Request, pd: PDParams) -> list[RequestOutput]:
        if not pd.prefill_addr:
            raise ValueError("a PD decode request needs the prefill instance's address (pd.prefill_addr)")
        if pd.transfer_id in self._by_tid:
            raise ValueError(f"PD transfer id {pd.transfer_id!r} is already in use")
        self.scheduler._check_length(request)
        endpoints = [e for e in self.endpoints if pd.transport in (None, e.protocol)]
        if not endpoints:
            raise ValueError(f"this decode instance does not offer the {pd.transport} cache transfer protocol "
                             f"(it offers {','.join(e.protocol for e in self.endpoints)})")
        inc = _Incoming(request, pd.transfer_id, pd.prefill_addr,
                        queue_deadline=time.time() + QUEUE_TIMEOUT_LEASES * self.config.pd_transfer_timeout,
                        endpoints=endpoints)
        self._by_tid[pd.transfer_id] = inc
        self._by_rid[request.request_id] = inc
        self._queue.append(inc)
        self._admit()
        return []

    def transfers(self, chunks: list[ScheduledChunk]) -> list[TransferPlan]:
        return []

    def poll(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self.service.transfer_reports()  # none come on D: this only takes the receivers' stats
        for addr, dealer in list(self._dealers.items()):
            while True:
                try:
                    raw = dealer.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if (msg := self._decode(raw, addr)) is None:
                    continue
                inc = self._by_tid.get(msg.transfer_id)
                if inc is None:
                    continue  # late: the lease ended or the request was aborted
                if isinstance(msg, PrefillDone):
                    outputs += self._on_prefill_done(inc, msg)
                elif isinstance(msg, LeaseRenew):
                    if inc.request.status is RequestStatus.PREALLOCATED:
                        inc.lease_deadline = time.time() + self.config.pd_transfer_timeout
                elif isinstance(msg, PDError):
                    outputs.append(self._give_up(inc, f"the prefill instance failed: {msg.error}", tell_prefill=False))
        now = time.time()
        for inc in [i for i in self._by_tid.values() if now > i.lease_deadline]:
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
        if inc is None or inc.request.status is RequestStatus.RUNNING:
            return None  # decoding already: an ordinary abort
        self._forget(inc)
        r = inc.request
        if r.status is RequestStatus.PREALLOCATED:
            self._send(inc, PDError(inc.transfer_id, "the decode instance's request was aborted"))
            self._quarantine_blocks(inc)
            self.scheduler.abort(request_id)
        else:  # still queued for blocks; P has heard nothing
            self._queue.remove(inc)
            r.status, r.finish_reason = RequestStatus.FINISHED, "abort"
        return r

    def next_deadline(self) -> float | None:
        deadlines = [i.lease_deadline for i in self._by_tid.values()] + [t for t, _ in self._quarantine]
        return min(deadlines, default=None)

    def close(self) -> None:
        for dealer in self._dealers.values():
            dealer.close()

    def stats_dict(self) -> dict:
        return {**super().stats_dict(), "pd_queued_for_blocks": len(self._queue),
                "pd_quarantined_blocks": sum(len(b) for _, b in self._quarantine),
                "kv_refused_connections": self.service.refused_connections}

    # ---- internals ---------------------------------------------------------------------------

    def _admit(self) -> None:
        """Preallocate for queued requests in order while blocks allow; send P their cache info.
        D's own preempted requests (back in the scheduler's queue) get freed blocks first."""
        while self._queue and not self.scheduler.waiting:
            inc = self._queue[0]
            if not self.scheduler.preallocate(inc.request):
                return
            self._queue.popleft()
            r = inc.request
            now = time.time()
            r.times.preallocated = now
            inc.lease_deadline = now + self.config.pd_transfer_timeout
            info = CacheInfo(inc.transfer_id, r.num_prompt_tokens, prompt_digest(r.prompt_token_ids),
                             [b.block_id for b in r.blocks], self.layout, inc.endpoints,
                             self.config.pd_transfer_timeout, inc.lease_deadline)
            self._send(inc, info)
            r.times.cache_info_sent = time.time()

    def _on_prefill_done(self, inc: _Incoming, msg: PrefillDone) -> list[RequestOutput]:
        self._forget(inc)
        self._send(inc, PrefillAck(inc.transfer_id))
        r = inc.request
        t = r.times
        t.prefill_done_received = time.time()
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

    def _give_up(self, inc: _Incoming, error: str, tell_prefill: bool = True) -> RequestOutput:
        self._forget(inc)
        r = inc.request
        if r.status is RequestStatus.PREALLOCATED:
            if tell_prefill:
                self._send(inc, PDError(inc.transfer_id, error))
            self._quarantine_blocks(inc)
            self.scheduler.abort(r.request_id)
        elif inc in self._queue:
            self._queue.remove(inc)
            self._send(inc, PDError(inc.transfer_id, error))  # P may be waiting for cache info
        return self._fail_request(r, error)

    def _quarantine_blocks(self, inc: _Incoming) -> None:
        """Keep the blocks out of the pool until P cannot be writing into them any more."""
        blocks, inc.request.blocks = inc.request.blocks, []
        release = min(inc.lease_deadline, time.time() + self.config.pd_transfer_timeout) + QUARANTINE_GRACE
        self._quarantine.append((release, blocks))

    def _release_quarantine(self, now: float) -> None:
        keep = []
        for release, blocks in self._quarantine:
            if now >= release:
                self.scheduler.kv.pool.free(reversed(blocks))
            else:
                keep.append((release, blocks))
        self._quarantine = keep

    def _forget(self, inc: _Incoming) -> None:
        self._by_tid.pop(inc.transfer_id, None)
        self._by_rid.pop(inc.request.request_id, None)

    def _send(self, inc: _Incoming, msg: object) -> None:
        dealer = self._dealers.get(inc.prefill_addr)
        if dealer is None:
            dealer = self._dealers[inc.prefill_addr] = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 10_000)
            # A fixed identity: after a reconnect P's replies still find this socket.
            dealer.setsockopt(zmq.ROUTING_ID, f"d-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
            dealer.connect(f"tcp://{inc.prefill_addr}")
        try:
            dealer.send(self._encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # P unreachable: the lease ends this request
