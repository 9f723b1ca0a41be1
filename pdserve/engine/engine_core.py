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
from pdserve.engine.kv_connector import CacheService, KVConnector, NoCacheService
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineInput,
    EngineOutputs,
    RequestOutput,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from pdserve.engine.request import Request
from pdserve.engine.request_output import error_output, final_output
from pdserve.engine.role_connectors import RoleConnectors
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.stats import EngineStats, copied
from pdserve.engine.worker_client import WorkerClient
from pdserve.kv.disk_writer import QUEUE_BYTES
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer_plan import TransferPlan
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.spec_decode.stats import SpecDecodeCounts
from pdserve.utils.child_process import ChildDied
from pdserve.utils.process import raise_if_stopping
from pdserve.worker.protocol import Chunk, ExecuteStep, NewRequest, StepResult

log = logging.getLogger("pdserve.engine")

DISK_DUMP_S = 8.0  # a clean stop's writes to the disk tier, at most (the API server waits 15 s for the engine)


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

    # ---- the loop ------------------------------------------------------------------------------

    def run(self, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(EngineInput)
        encoder = msgspec.msgpack.Encoder()
        while True:
            raise_if_stopping()
            pending: list[RequestOutput] = []
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
                    self._write_tiers_to_disk()
                    return
                if isinstance(msg, UtilityCall):
                    result, aborted = self._utility(msg)
                    if aborted:
                        outputs.send(encoder.encode(EngineOutputs(aborted)))
                    outputs.send(encoder.encode(result))
                else:
                    pending.extend(self._handle(msg))
            if not self.worker.alive():
                raise ChildDied(self.worker.exit_message())  # no traceback
            self._check_cache_service()
            self._poll_host_tier()
            self.scheduler.poll_loads()
            pending.extend(self._poll_connector())
            if self.scheduler.has_work or self.copies.pending:
                pending.extend(self.step())
            self._publish_kv_events()
            load = self._load_report_due()
            if pending or load is not None:
                outputs.send(encoder.encode(EngineOutputs(pending, load)))

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

    def _poll_host_tier(self) -> None:
        """Saves to the host tier that completed give their device blocks back; disk writes that finished
        make their blocks readable from the disk tier."""
        if self.kv.host is not None:
            for save_id, host_blocks in self.copies.blocks_saved():
                self.kv.saved(save_id, host_blocks)
        if self.kv.disk is not None and (done := self.copies.disk_written()) != ([], []):
            self.kv.disk_written(*done)

    def _write_tiers_to_disk(self, timeout: float = DISK_DUMP_S) -> None:
        """A clean stop with a disk tier: the prefix blocks of the device cache and the host tier that the disk
        lacks are written, for `timeout` seconds at most, so that a restart comes back with all it had."""
        if self.kv.disk is None:
            return
        start = time.monotonic()
        ordered: set[bytes] = set()
        queue = QUEUE_BYTES // self.layout.block_bytes  # what the cache service's writer takes at once
        while time.monotonic() - start < timeout:
            more = self.kv.write_tiers_to_disk(ordered, queue // 2 - self.kv.disk_writes_in_flight)
            if not more and not self.kv.saves_in_flight and not self.kv.disk_writes_in_flight:
                break
            if self.copies.pending:
                self._run_copies_only()
            else:
                zmq.select(self.cache_service.sockets, [], [], 0.05)
            self._poll_host_tier()
        left = self.kv.saves_in_flight + self.kv.disk_writes_in_flight
        log.info("disk KV tier: %d blocks the disk lacked ordered written at stop, in %.1f s%s", len(ordered),
                 time.monotonic() - start, f"; {left} unfinished when the time ran out" if left else "")

    def _wait_for_host_saves(self, timeout: float = 10.0) -> None:
        """Until no device block is held for a copy to the host tier (they are seconds at most)."""
        deadline = time.monotonic() + timeout
        while self.kv.saves_in_flight and time.monotonic() < deadline:
            if self.copies.pending:
                self._run_copies_only()
            else:
                zmq.select(self.copies.sockets, [], [], 0.05)
            self._poll_host_tier()

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

    def _handle(self, msg: AddRequest | AbortRequests) -> list[RequestOutput]:
        if isinstance(msg, AbortRequests):
            return [final_output(r) for rid in msg.request_ids if (r := self.abort(rid)) is not None]
        if not self.weights_loaded:
            return [RequestOutput(msg.request_id, [], finish_reason="error",
                                  error="the model weights are cleared; POST /update_model_weight loads them",
                                  error_status=503,
                                  num_prompt_tokens=len(msg.prompt_token_ids))]
        if msg.lora_name is not None and msg.lora_name not in self.loras:  # unloaded since the API checked it
            return [RequestOutput(msg.request_id, [], finish_reason="error",
                                  error=f"the LoRA adapter '{msg.lora_name}' is not loaded",
                                  num_prompt_tokens=len(msg.prompt_token_ids))]
        request = Request(msg.request_id, msg.prompt_token_ids, msg.params, tuple(msg.eos_token_ids),
                          num_resumed=msg.num_resumed, priority=msg.priority, lora_name=msg.lora_name,
                          kv_pull=msg.kv_pull if self.kv.pulls is not None else None)
        request.times.arrival = msg.arrival_time
        if msg.trace_steps:
            request.times.steps = []
        try:
            if msg.pd is None:
                self.scheduler.add_request(request)
                return []
            if msg.params.prompt_logprobs is not None:
                raise ValueError("prompt logprobs (echo with logprobs, prompt_logprobs) are not served by a PD pair: "
                                 "send the request without `pd`, to one instance (pdserve's router does)")
            return self.connector.add_request(request, msg.pd)
        except ValueError as e:
            return [RequestOutput(msg.request_id, [], finish_reason="error", error=str(e),
                                  num_prompt_tokens=len(msg.prompt_token_ids))]
        return []

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
            result = self.worker.execute(step, while_waiting=self._during_step)
        except ChildDied:  # the worker or the cache service is gone: so is this engine
            raise
        except RuntimeError as e:
            if not self.worker.alive():
                raise
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
                                len(drafts), r.lora_name))
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

    def stats(self) -> EngineStats:
        """Copies of the components' figures (they go on adding to their own), gauges read now."""
        pool, kv = self.kv.pool, self.kv
        return EngineStats(
            num_blocks=pool.num_blocks, free_blocks=pool.num_free_blocks, cached_blocks=pool.num_cached_blocks,
            kv_usage=pool.usage(), running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            preallocated=len(self.scheduler.preallocated), num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps, num_computed_tokens=self.num_computed_tokens,
            prefix_cache=copied(kv.stats), weights_loaded=self.weights_loaded,
            host_tier=None if kv.host is None else copied(kv.host.stats, blocks=kv.host.num_blocks,
                                                          blocks_used=kv.host.num_used_blocks),
            disk_tier=None if kv.disk is None else copied(kv.disk.stats, blocks=len(kv.disk),
                                                          capacity_blocks=kv.disk.capacity_blocks),
            prefix_pulls=None if kv.pulls is None else copied(kv.pulls.stats, bandwidth=kv.pulls.bandwidth),
            prefill_rate=self.load.prompt_step_rate, spec_decode=self._spec_decode_stats(), pd=self.connector.stats())

    def _spec_decode_stats(self) -> SpecDecodeCounts | None:
        scheduler = self.scheduler
        if scheduler.proposer is None:
            return None
        return scheduler.spec_stats.counts(scheduler.controller.as_dict() if scheduler.controller is not None else {})

    def _utility(self, call: UtilityCall) -> tuple[UtilityResult, list[RequestOutput]]:
        """Answer a utility call; also returns outputs of requests it ended (clear_weights aborts all)."""
        aborted: list[RequestOutput] = []
        try:
            if call.method == "clear_weights":
                aborted = [final_output(r) for rid in list(self.scheduler.requests) if (r := self.abort(rid))]
                self.kv.reset_prefix_cache()  # cached KV dies with the cache memory
                self.weights_loaded = False
                while self.copies.pending:  # the aborts' host-tier saves, while the cache still exists
                    self._run_copies_only()
                self._poll_host_tier()
                self.worker.weights("clear")
                self.cache_service.worker_cache_freed()
                return UtilityResult(call.call_id, {"aborted": len(aborted)}), aborted
            if call.method == "set_role":
                return self._set_role(call), []
            if call.method in ("load_lora", "unload_lora"):
                return self._lora(call), []
            if call.method == "load_weights":
                ok = self.worker.weights("load")
                self.cache_service.worker_cache_created(self.layout, ok.kv_cache_name)
                self.weights_loaded = True
                return UtilityResult(call.call_id, {}), []
        except RuntimeError as e:  # the worker reported a failure; it is still alive
            return UtilityResult(call.call_id, error=str(e)), aborted
        return self._query(call), []

    def _set_role(self, call: UtilityCall) -> UtilityResult:
        """Change role in place (--enable-role-switch): the weights and the KV cache (its prefix index too) stay,
        and what is in flight goes on (role_connectors.py)."""
        try:
            role = Role(call.args.get("role", ""))
        except ValueError:
            return UtilityResult(call.call_id, error=f"role must be one of {', '.join(Role)}")
        if (why := self.connector.can_take(role)) is not None:
            return UtilityResult(call.call_id, error=why)
        before, self.connector.role = self.connector.role, role
        self.scheduler.set_role(role)
        log.info("role changed in place: %s -> %s (%d requests and %d transfers in flight go on)", before, role,
                 self.scheduler.num_unfinished, self.connector.held)
        return UtilityResult(call.call_id, {"role": str(role), "sides": self.connector.sides})

    def _lora(self, call: UtilityCall) -> UtilityResult:
        name = call.args.get("name", "")
        if call.method == "unload_lora":
            in_use = sum(1 for r in self.scheduler.requests.values() if r.lora_name == name)
            if in_use:
                return UtilityResult(call.call_id, error=f"LoRA adapter {name!r} is in use by {in_use} requests")
            self.worker.lora("unload", name)
            self.loras.discard(name)
        else:
            self.worker.lora("load", name, call.args.get("path", ""))
            self.loras.add(name)
        return UtilityResult(call.call_id, {})

    def _query(self, call: UtilityCall) -> UtilityResult:
        try:
            if call.method == "stats":
                return UtilityResult(call.call_id, stats=self.stats())
            if call.method == "check_idle":
                if self.scheduler.num_unfinished:
                    raise AssertionError(f"{self.scheduler.num_unfinished} requests are still unfinished")
                self._wait_for_host_saves()
                self.kv.pool.check_all_free()
                return UtilityResult(call.call_id, stats=self.stats())
            if call.method == "reset_prefix_cache":
                self.kv.reset_prefix_cache()
                return UtilityResult(call.call_id, {})
            raise ValueError(f"unknown utility method {call.method!r}")
        except (AssertionError, ValueError) as e:
            return UtilityResult(call.call_id, error=str(e))
