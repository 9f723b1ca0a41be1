"""The engine loop: take requests from the frontend, schedule a step, run it on the worker, report.

It runs in its own process (see `__main__.py`) so the scheduler never waits on the frontend's
tokenizing or HTTP work, and the frontend never waits on a forward pass.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from pdserve.admission.load import LoadReport, LoadTracker
from pdserve.config.engine import EngineConfig
from pdserve.config.roles import Role
from pdserve.engine.block_copies import BlockCopies
from pdserve.engine.intake import Intake
from pdserve.engine.kv_connector import CacheService, KVConnector, NoCacheService
from pdserve.engine.messages import (
    EngineInput,
    RequestOutput,
    Shutdown,
    UtilityCall,
)
from pdserve.engine.outbox import Outbox
from pdserve.engine.request import Request
from pdserve.engine.request_output import error_output, final_output
from pdserve.engine.role_connectors import RoleConnectors
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.tier_upkeep import TierUpkeep
from pdserve.engine.utilities import EngineUtilities
from pdserve.engine.worker_client import WorkerClient, WorkerFailed
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer_plan import TransferPlan
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.utils.child_process import ChildDied
from pdserve.utils.process import raise_if_stopping
from pdserve.worker.protocol import Chunk, ExecuteStep, NewRequest, StepResult

log = logging.getLogger("pdserve.engine")


def _prompt_and_decode_work(out: SchedulerOutput) -> tuple[int, int]:
    """(prompt tokens computed, streams decoded) in a step; a decode's proposals count as neither."""
    decodes = sum(1 for c in out.chunks if c.num_new_tokens - len(c.draft_token_ids) == 1 and c.completes_known_tokens)
    drafts = sum(len(c.draft_token_ids) for c in out.chunks)
    return out.num_batched_tokens - decodes - drafts, decodes


class StepFailed(Exception):
    """The worker reported that a step failed; it is alive and takes the next one."""


class EngineCore:
    """Built whole by instance/build.py: the scheduler (with its KV cache manager), the worker, and what the
    instance's row of the startup table gave it (a connector for PD roles, the cache service, who copies
    blocks to and from host memory)."""

    IDLE_POLL_MS = 500
    LOAD_INTERVAL = 0.02  # seconds between load reports while busy (one more after it goes idle)

    def __init__(self, config: EngineConfig, worker: WorkerClient, scheduler: Scheduler, layout: KVLayout,
                 copies: BlockCopies, connectors: dict[Role, KVConnector] | None = None,
                 cache_service: CacheService | None = None, kv_events: KVEventPublisher | None = None) -> None:
        self.config = config
        self.worker = worker
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.layout = layout
        self.copies = copies
        self.connector = RoleConnectors(config.splitwise_role, connectors or {})
        self.cache_service: CacheService = cache_service or NoCacheService()
        self.kv_events = kv_events
        self._on_worker: set[str] = set()  # request ids whose sampling state the worker holds
        self._finished_on_worker: list[str] = []
        self.num_computed_tokens = 0  # all tokens run through the model (prefix hits excluded)
        self.num_steps = 0
        self.weights_loaded = True
        self.loras = {m.name for m in config.lora_modules}  # the adapters the worker holds (requests may name)
        self.load = LoadTracker(config.max_num_seqs, config.max_num_batched_tokens)
        self._load_sent = 0.0  # monotonic time of the last report
        self._load_idle_sent = False  # the report after the last work went out
        self.tiers = TierUpkeep(self.kv, copies, self.cache_service, layout.block_bytes, self._run_copies_only)
        self.intake = Intake(self)
        self.utilities = EngineUtilities(self)
        self.outbox: Outbox  # run() opens it on the frontend's socket

    # ---- the loop ------------------------------------------------------------------------------

    def run(self, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(EngineInput)
        self.outbox = Outbox(outputs)
        while True:
            raise_if_stopping()
            timeout = 0 if self.scheduler.has_work else self._idle_timeout_ms()
            if timeout:
                self.load.cycle_over(time.perf_counter())  # a wait is not part of the last step's cycle
            if sockets := self._peer_sockets():
                poller = zmq.Poller()
                for sock in (inputs, *sockets):
                    poller.register(sock, zmq.POLLIN)
                poller.poll(timeout)
                timeout = 0
            while inputs.poll(timeout):
                msg = decoder.decode(inputs.recv())
                timeout = 0
                if isinstance(msg, Shutdown):
                    self.tiers.write_to_disk_at_stop()
                    return
                if isinstance(msg, UtilityCall):
                    result, aborted = self.utilities.answer(msg)
                    self.outbox.add(aborted)
                    self.outbox.answer(result)
                else:
                    self.outbox.add(self.intake.handle(msg))
            if not self.worker.alive():
                raise ChildDied(self.worker.exit_message())  # no traceback
            self._check_cache_service()
            self.tiers.poll()
            self.scheduler.poll_loads()
            self.outbox.add(self._poll_connector())
            if self.scheduler.has_work or self.copies.pending:
                self.outbox.add(self.step())  # the step sent what was held once the worker had it
            self._publish_kv_events()
            self.outbox.report(self._load_report_due())
            if not self.scheduler.has_work:  # no step comes next to send them behind
                self.outbox.send()

    def _load_report_due(self) -> LoadReport | None:
        """A load report every LOAD_INTERVAL while there is work, and one when it has all gone."""
        busy = self.scheduler.num_unfinished > 0
        now = time.monotonic()
        if (busy and now - self._load_sent >= self.LOAD_INTERVAL) or (not busy and not self._load_idle_sent):
            self._load_sent, self._load_idle_sent = now, not busy
            return self.load.report(*self.scheduler.load())
        return None

    def _check_cache_service(self) -> None:
        if not self.cache_service.alive():
            raise ChildDied(f"the cache service process exited (code {self.cache_service.exit_code()})")

    def _during_step(self) -> None:
        """While the worker computes: lease renewals, and a cache service that died (a prefill worker
        would otherwise wait for its messager until the step's own timeout)."""
        self.connector.during_step()
        self._check_cache_service()

    def _peer_sockets(self) -> list[zmq.Socket]:
        sockets = list(self.connector.sockets)
        if self.kv.host is not None:
            sockets += [s for s in self.copies.sockets if s not in sockets]
        if self.kv_events is not None:
            sockets += self.kv_events.sockets
        return sockets

    def _publish_kv_events(self) -> None:
        """What this turn of the loop changed in the prefix cache, as one batch; then replay requests."""
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.events.take())
            self.kv_events.serve_replays()

    def _run_copies_only(self) -> None:
        """A step with no chunks, for copies nothing scheduled would carry (a swap-in on an idle D,
        host-tier saves after the last request)."""
        try:
            self._execute([], [], [])
        except StepFailed as e:
            log.error("block copies failed: %s", e)

    def _poll_connector(self) -> list[RequestOutput]:
        outputs = self.connector.poll()
        for out in outputs:
            if out.finish_reason is not None:  # ended by the connector (a failed transfer)
                self.forget(out.request_id)
        return outputs

    def _idle_timeout_ms(self) -> int:
        deadlines = [d for d in (self.connector.next_deadline(), self.kv.next_load_deadline) if d is not None]
        deadline = min(deadlines, default=None)
        if deadline is None or deadline == float("inf"):
            return self.IDLE_POLL_MS
        return max(0, min(self.IDLE_POLL_MS, int((deadline - time.time()) * 1000) + 1))

    def abort(self, request_id: str) -> Request | None:
        request = self.connector.abort(request_id) or self.scheduler.abort(request_id)
        if request is not None:
            self.forget(request.request_id)
        return request

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute on the worker, apply what it sampled."""
        cycle_started = time.perf_counter()
        self.load.step_started(cycle_started)
        out = self.scheduler.schedule()
        if not out.chunks:
            self.outbox.send()
            if self.copies.pending:
                self._run_copies_only()
            else:
                time.sleep(0.001)  # nothing fits now (blocks held elsewhere); do not spin hot
            return []
        started = time.perf_counter()
        try:
            result = self._execute(self._new_on_worker(out), self._chunks(out), self.connector.transfers(out.chunks))
        except StepFailed as e:
            return [o for c in out.chunks if (o := self._fail(c.request, f"the model step failed: {e}"))]
        seconds = time.perf_counter() - started
        self.load.step_done(*_prompt_and_decode_work(out), cycle_started)
        return self._apply(out, result, seconds)

    def _execute(self, new_requests: list[NewRequest], chunks: list[Chunk],
                 transfers: list[TransferPlan]) -> StepResult:
        """One step on the worker, with the block copies queued for it. A failure the worker reported (it is
        alive) raises StepFailed; its copies count as done (the worker runs them before the forward)."""
        copies = self.copies.take()
        step = ExecuteStep(new_requests, self._finished_on_worker, chunks, transfers, copies)
        self._finished_on_worker = []
        try:
            result = self.worker.execute(step, while_waiting=self._during_step, sent=self.outbox.send)
        except WorkerFailed as e:
            self.copies.done([c.copy_id for c in copies])
            raise StepFailed(str(e)) from None
        self.copies.done(result.copies_done)
        return result

    def _new_on_worker(self, out: SchedulerOutput) -> list[NewRequest]:
        """The scheduled requests the worker has not seen: their sampling state goes with this step."""
        new = []
        for c in out.chunks:
            r = c.request
            if r.request_id not in self._on_worker:
                self._on_worker.add(r.request_id)
                new.append(NewRequest(r.request_id, r.prompt_token_ids, r.params, list(r.eos_token_ids),
                                      list(r.output_token_ids), r.num_resumed))
        return new

    @staticmethod
    def _chunks(out: SchedulerOutput) -> list[Chunk]:
        chunks = []
        for c in out.chunks:
            r = c.request
            start, drafts = r.num_computed_tokens, c.draft_token_ids
            tokens = r.token_ids[start:start + c.num_new_tokens - len(drafts)] + drafts
            chunks.append(Chunk(r.request_id, tokens, start, [b.block_id for b in r.blocks], c.completes_known_tokens,
                                len(drafts), r.lora_name, _group_tables(r)))
        return chunks

    def _apply(self, out: SchedulerOutput, result: StepResult, seconds: float) -> list[RequestOutput]:
        self.num_steps += 1
        self.num_computed_tokens += out.num_batched_tokens
        for pl in result.prompt_logprobs:
            if (request := self.scheduler.requests.get(pl.request_id)) is not None:
                request.add_prompt_logprobs(pl.first_position, pl.entries)
        outputs = []
        for s in result.sampled:
            if s.error is not None and (request := self.scheduler.requests.get(s.request_id)) is not None:
                outputs.extend(o for o in [self._fail(request, s.error, 400)] if o is not None)
        sampled = {s.request_id: s for s in result.sampled if s.error is None}
        changed = self.scheduler.update(out, {rid: s.token_ids for rid, s in sampled.items()})
        self.scheduler.observe_step(out, sum(n for _, n in changed), seconds)
        for r, n in changed:
            s = sampled[r.request_id]
            output = final_output(r) if r.is_finished else RequestOutput(r.request_id, [])
            output.new_token_ids = s.token_ids[:n]
            output.new_logprobs = s.logprobs[:n] if s.logprobs is not None else None
            if r.params.prompt_logprobs is not None and not r.prompt_logprobs_sent:
                output.prompt_logprobs, r.prompt_logprobs_sent = r.prompt_logprobs, True
            if r.is_finished:
                self.forget(r.request_id)
                if r.kv_producer:
                    self.connector.on_prefilled(r, s.token_ids[0], s.logprobs[0] if s.logprobs else None)
            outputs.append(output)
        return outputs

    # ---- helpers -----------------------------------------------------------------------------

    def _fail(self, request: Request, error: str, status: int = 500) -> RequestOutput | None:
        if request.is_finished:
            return None
        self.abort(request.request_id)
        return error_output(request, error, status)

    def forget(self, request_id: str) -> None:
        """The worker may drop the request's sampling state (told with the next step)."""
        if request_id in self._on_worker:
            self._on_worker.discard(request_id)
            self._finished_on_worker.append(request_id)


def _group_tables(request: Request) -> list[list[int]]:
    """Layer groups 1..'s tables for the worker (engine/group_tables.py): 0 where a block is gone."""
    return [[0 if b is None else b.block_id for b in table] for table in request.group_blocks]
