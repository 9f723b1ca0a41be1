"""The step scheduler (the seeds' "v1" scheduler): who gets how many tokens computed this step.

Per step there is a token budget (`max_num_batched_tokens`). Running requests go first: each decode
takes one token, and an unfinished prefill takes the next chunk. Then waiting requests are
admitted in the order of `--scheduling-policy` (waiting_queue.py: arrival, or priority then arrival)
while the budget, `max_num_seqs` and the KV blocks allow; a prompt longer than what is left of the
budget is cut into chunks (chunked prefill). When blocks run out for a running request, one is
preempted (fcfs: the most recently admitted; priority: the lowest priority, latest arrival): its
blocks are freed and it goes back to the queue, to be recomputed later, so older (or more urgent)
requests finish first.

PD requests change only the ends of the lifecycle: on a prefill instance a `kv_producer` request
finishes after its first token and keeps its blocks (the PD connector frees them once the KV is
sent); a decode instance holds blocks for a request whose prompt KV is written from outside
(`preallocate`) and starts decoding it when told (`mark_prefilled`). The connector (engine/
kv_connector.py) uses only the public methods here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pdserve.config.engine import EngineConfig
from pdserve.config.roles import Role
from pdserve.config.speculative import SpeculativeConfig
from pdserve.engine.block_pool import Block
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.messages import StepTime
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.engine.waiting_queue import WaitingQueue
from pdserve.kv.block_hash import BlockHash
from pdserve.sampling import check_stop
from pdserve.spec_decode.controller import SpeculationController
from pdserve.spec_decode.ngram_proposer import NgramProposer
from pdserve.spec_decode.stats import SpecDecodeCounts, SpecDecodeStats

_ENGINE = EngineConfig()  # the scheduler's defaults are the engine's


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine config's scheduling fields, with what only the loaded model tells (its length, vocabulary)."""

    max_num_seqs: int = _ENGINE.max_num_seqs
    max_num_batched_tokens: int = _ENGINE.max_num_batched_tokens
    max_model_len: int = 8192
    enable_chunked_prefill: bool = _ENGINE.enable_chunked_prefill
    role: Role = _ENGINE.splitwise_role
    vocab_size: int | None = None  # when known, prompt ids are checked against it at admission
    speculative: SpeculativeConfig | None = None  # n-gram speculation for decoding requests
    policy: str = _ENGINE.scheduling_policy  # fcfs | priority
    max_loras: int = _ENGINE.max_loras  # distinct LoRA adapters in one step

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int, vocab_size: int | None = None) -> SchedulerConfig:
        return cls(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                   role=config.splitwise_role, vocab_size=vocab_size, speculative=config.speculative_config,
                   policy=config.scheduling_policy, max_loras=config.max_loras)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ValueError(f"role must be one of {', '.join(Role)}, got {self.role!r}") from None
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be at least max_model_len ({self.max_model_len})")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.preallocated: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}  # waiting for prefix blocks from the disk tier or a peer
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._speculate(config)
        self.spec_stats = SpecDecodeStats(config.speculative.num_speculative_tokens if config.speculative else 0)
        self.step_loras: set[str] = set()  # the LoRA adapters the last step computed with

    def _speculate(self, config: SchedulerConfig) -> None:
        spec = config.speculative if config.role != Role.PREFILL else None  # P stops after one token
        self.proposer = NgramProposer(spec) if spec is not None else None
        self.max_speculating = spec.disable_by_batch_size if spec is not None else None
        self.controller = SpeculationController() if spec is not None and self.max_speculating is None else None

    def set_role(self, role: Role) -> None:
        """The instance changed role in place. A proposer is added where the new role speculates, never taken away
        (a stream decoding on may be mid-speculation; a prefill-side request stops after one token anyway)."""
        self.config = replace(self.config, role=role)
        if self.proposer is None:
            self._speculate(self.config)

    def spec_decode_counts(self) -> SpecDecodeCounts | None:
        """Proposals and acceptances so far (None: this instance does not speculate)."""
        if self.proposer is None:
            return None
        return self.spec_stats.counts(self.controller.as_dict() if self.controller is not None else {})

    # ---- admission and removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request.status is RequestStatus.PREALLOCATED:
            del self.preallocated[request_id]
        elif request_id in self.loading:  # its load finishes in the host tier; nobody waits for it
            del self.loading[request_id]
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self._finish(request, "abort")
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.preallocated) + len(self.loading)

    def poll_loads(self) -> None:
        """Requests whose prefix loads (disk reads, pulls) have finished go back to the head of the queue."""
        for request_id in self.kv.finish_loads():
            if (request := self.loading.pop(request_id, None)) is not None:
                self.waiting.requeue(request)

    @property
    def has_waiting(self) -> bool:
        """Requests queued for admission (preempted ones included): they go before new PD preallocations."""
        return bool(self.waiting)

    def free_blocks(self, request: Request) -> None:
        """A finished KV producer's blocks, once its KV went out (or will not)."""
        self.kv.free(request)

    def can_preallocate(self, request: Request, cached: list[Block] = (),
                        window_cached: list[list[Block]] | None = None) -> bool:
        """preallocate() would succeed now (nothing is taken)."""
        return not self.waiting and self.kv.can_allocate(request, self._preallocated_tokens(request, cached), cached,
                                                         request.num_prompt_tokens, window_cached)

    def cached_prefix(self, request: Request) -> list[Block] | None:
        """The prompt's leading blocks already in this instance's prefix cache (nothing taken); None while some
        are being loaded into the host tier (ask again later)."""
        return self.kv.find_cached_prefix(request)

    def hold_blocks(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks, so that eviction leaves them (release_blocks gives it back)."""
        self.kv.pool.take(blocks)

    def release_blocks(self, blocks: list[Block]) -> None:
        """Blocks taken off a request earlier (a decode connector's quarantine) go back to the pool."""
        self.kv.release(reversed(blocks))

    @property
    def has_work(self) -> bool:
        """Something to compute (preallocated requests wait for KV from outside, not for a step)."""
        return bool(self.waiting or self.running)

    # ---- decode role: prompt KV filled from outside ------------------------------------------

    def preallocate(self, request: Request, cached: list[Block] = (),
                    window_cached: list[list[Block]] | None = None) -> bool:
        """Reserve blocks for the whole prompt (plus the first generated token) of a request whose
        prompt KV another instance will write, the `cached` prefix (cached_prefix) taken as it is (and with layer
        groups `window_cached`, window_hits() of it, where the caller has held them since). False (and nothing
        held) when blocks are short."""
        self.check_request(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not self.kv.allocate(request, self._preallocated_tokens(request, cached), cached,
                                request.num_prompt_tokens, window_cached):  # its first query: the first decode step
            return False
        request.num_cached_tokens = len(cached) * self.kv.block_size
        self.kv.record_hits(request, request.num_prompt_tokens)
        request.status = RequestStatus.PREALLOCATED
        self.requests[request.request_id] = request
        self.preallocated[request.request_id] = request
        return True

    def _preallocated_tokens(self, request: Request, cached: list[Block]) -> int:
        return request.num_prompt_tokens + 1 - len(cached) * self.kv.block_size

    def window_hits(self, request: Request, cached: list[Block]) -> list[list[Block]]:
        """With layer groups: each sliding group's cached blocks of the `cached` prefix that preallocate() would
        take (those its first decode step can see)."""
        return self.kv.window_hits(request, len(cached), request.num_prompt_tokens)

    def mark_prefilled(self, request_id: str, first_token: int) -> Request:
        """The prompt KV has arrived: start decoding from the prefill instance's first token."""
        request = self.preallocated.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.commit_computed(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if reason := self._append_tokens(request, [first_token])[0]:
            self._finish(request, reason)
        return request

    def load(self) -> tuple[dict[int, int], int, int, int | None, list[str]]:
        """For the load report: prompt tokens still to compute by priority (a waiting prompt's without the prefix
        it will find cached, computed by a request ahead of it if need be), streams decoding, streams that will
        join them (queued, mid-prefill, awaiting KV; none on a prefill instance), the fewest tokens a decoding
        stream has left before its limit (None when none decodes), and the LoRA adapters of
        the last step."""
        queued: dict[int, int] = {}
        decoding, joining, fewest_left = 0, 0, None
        coming: set[BlockHash] = set()  # blocks the requests before this one compute: it will find them cached
        for r in (*self.running, *self.loading.values(), *self.waiting):
            todo = r.num_tokens - r.num_computed_tokens
            if r.num_computed_tokens == 0 and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                todo -= self.kv.expected_cached_blocks(r, coming) * self.kv.block_size
                coming.update(r.block_hashes)
            elif r.status is not RequestStatus.RUNNING or todo > 1:
                coming.update(r.block_hashes)
            if r.status is RequestStatus.RUNNING and todo == 1:
                decoding += 1
                limit = self.config.max_model_len - r.num_tokens
                if r.params.max_tokens is not None:
                    limit = min(limit, r.params.max_tokens - len(r.output_token_ids) - r.num_resumed)
                fewest_left = limit if fewest_left is None else min(fewest_left, limit)
            else:
                queued[r.priority] = queued.get(r.priority, 0) + todo
                joining += not r.kv_producer
        return queued, decoding, joining + len(self.preallocated), fewest_left, sorted(self.step_loras)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Running requests first (oldest first, preempting the newest for blocks), then waiting ones in order."""
        out = SchedulerOutput()
        loras = _StepLoRAs(self.config.max_loras)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, loras)
        self._schedule_waiting(out, budget, loras)
        if out.chunks:
            self.step_loras = {c.request.lora_name for c in out.chunks if c.request.lora_name is not None}
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, loras: _StepLoRAs) -> int:
        """The running requests' next chunks (with their proposals); the budget left."""
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted below to make room for an older request
                continue
            if not loras.fits(request):  # (a decode instance's streams came in past admission) next step
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts, request.spec_token_ids = request.spec_token_ids[:budget - n], []
            if drafts and not self.kv.allocate(request, n + len(drafts)):
                drafts = []  # no blocks for the proposals: decode plainly rather than preempt anyone
            while not self.kv.allocate(request, n + len(drafts)):
                victim = self.waiting.victim(self.running)
                self.running.remove(victim)
                budget += self._unschedule(out, victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, n + len(drafts), drafts))
                budget -= n + len(drafts)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, loras: _StepLoRAs) -> None:
        """Waiting requests in order while the budget, the blocks and max_num_seqs allow (none after a preemption),
        and until one whose prompt goes on into blocks this step computes for another: next step it finds them
        cached (a burst on one prefix computes the prefix once, then the tails, where it computed the prefix
        again for every prompt that fit beside the first)."""
        computing = self._blocks_computing(out)
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not loras.fits(request):  # its adapter waits for one of the step's to finish
                break
            cached = self.kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            if cached is None:  # blocks of its prefix are on their way into the host tier: it waits aside
                self.loading[self.waiting.popleft().request_id] = request
                continue
            if len(cached) < len(request.block_hashes) and request.block_hashes[len(cached)] in computing:
                break
            todo = request.num_tokens - len(cached) * self.kv.block_size
            if todo > budget and not self.config.enable_chunked_prefill:
                break
            n = min(todo, budget)
            if not self.kv.allocate(request, n, cached):
                break
            self.waiting.popleft()
            self._admit(request, len(cached) * self.kv.block_size)
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n
            computing.update(request.block_hashes[len(cached):])

    def _blocks_computing(self, out: SchedulerOutput) -> set[BlockHash]:
        """The prompt blocks the step's chunks so far compute or that their requests compute later (empty without
        prefix caching, nobody would find them, or without a waiting request to ask)."""
        if not self.kv.enable_prefix_caching or not self.waiting:
            return set()
        bs = self.kv.block_size
        return {h for c in out.chunks for h in c.request.block_hashes[c.request.num_computed_tokens // bs:]}

    def _admit(self, request: Request, num_cached_tokens: int) -> None:
        if request.status is RequestStatus.WAITING:  # first admission, not a resume after preemption
            request.num_cached_tokens = num_cached_tokens
            self.kv.record_hits(request, request.num_tokens)
        request.num_computed_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.time()
        self.running.append(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Apply a finished step: advance computed tokens, append sampled tokens, finish requests.

        `sampled` maps request id -> tokens for the chunks that completed their known tokens: one, or
        with proposals the accepted ones and the token after them. Returns the requests that got new
        tokens (finished ones included), with how many (fewer than sampled when a stop came first).
        """
        changed = []
        ended = None  # read only for a traced request (AddRequest.trace_steps)
        for chunk in out.chunks:
            request = chunk.request
            if request.is_finished:  # aborted while the step ran
                continue
            if request.times.steps is not None:
                ended = ended or time.time()
                request.times.steps.append(StepTime(out.scheduled_at, ended, chunk.num_new_tokens))
            num_draft = len(chunk.draft_token_ids)
            request.num_computed_tokens += chunk.num_new_tokens - num_draft
            tokens = sampled.get(request.request_id)
            if tokens is None:
                self.kv.commit_computed(request)
                continue
            reason, n = self._append_tokens(request, tokens)
            if num_draft:
                self.spec_stats.record(num_draft, len(tokens) - 1)
                # the KV of accepted proposals is valid; a rejected one's is overwritten later, its blocks go
                request.num_computed_tokens = request.num_tokens - 1
                self.kv.trim(request)
            self.kv.commit_computed(request)
            if reason is not None:
                self._finish(request, reason)
            changed.append((request, n))
        if self.proposer is not None:
            self._propose()
        return changed

    def _propose(self) -> None:
        """N-gram proposals for the next step, if speculation pays at this batch size (the fixed
        disable_by_batch_size, or the controller's measurements)."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and not r.kv_producer]
        if not decoding or (self.max_speculating is not None and len(decoding) > self.max_speculating):
            return
        if self.controller is not None and not self.controller.decide(len(decoding)):
            return  # decided before proposing: a large batch does not pay for the search either
        for r in decoding:
            left = [self.config.max_model_len - r.num_tokens]
            if r.params.max_tokens is not None:  # the last emitted token is never a proposal
                left.append(r.params.max_tokens - len(r.output_token_ids) - r.num_resumed - 1)
            r.spec_token_ids = self.proposer.propose(r.token_ids, min(left))

    def observe_step(self, out: SchedulerOutput, num_emitted: int, seconds: float) -> None:
        """A finished step's time, for the speculation controller (decode-only steps tell it something)."""
        if self.controller is None or not out.chunks or out.preempted:
            return
        if all(c.num_new_tokens - len(c.draft_token_ids) == 1 and c.completes_known_tokens for c in out.chunks):
            self.controller.observe(len(out.chunks), any(c.draft_token_ids for c in out.chunks), num_emitted, seconds)

    # ---- internals -------------------------------------------------------------------------

    def _append_tokens(self, request: Request, tokens: list[int]) -> tuple[str | None, int]:
        """Append until a stop: (the finish reason or None, how many were appended)."""
        now = time.time()
        if request.times.first_token is None:
            request.times.first_token = now
        request.times.last_token = now
        reason = None
        for n, token in enumerate(tokens, 1):
            request.append_output(token)
            reason = check_stop(request.params, request.output_token_ids, request.eos_token_ids,
                                self.config.max_model_len - request.num_tokens, request.num_resumed)
            if reason is None and request.kv_producer:
                reason = "prefilled"  # the prefill instance's part ends with the first token
            if reason is not None:
                return reason, n
        return None, len(tokens)

    def _finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        request.mark_finished(reason)
        self.waiting.forget(request.request_id)
        if not request.kv_producer or reason in ("abort", "error"):
            self.kv.free(request)  # a finished producer's blocks are the PD connector's to free
        self.requests.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.times.preempted.append(time.time())
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.requeue(request)

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        """Take a preemption victim's chunk out of this step (by priority it may be one already scheduled);
        returns the tokens given back to the budget."""
        for i, chunk in enumerate(out.chunks):
            if chunk.request is request:
                del out.chunks[i]
                return chunk.num_new_tokens
        return 0

    def check_request(self, request: Request) -> None:
        """ValueError (the client's fault) when the prompt cannot be served here."""
        limit = self.config.max_model_len
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        vocab = self.config.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if vocab is not None:
            request.params.check_vocab(vocab)
        if request.num_prompt_tokens >= limit:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens, but this model's maximum "
                             f"context length (--max-model-len) is {limit}, which leaves no room to generate")


class _StepLoRAs:
    """The adapters of the step being built: at most max_loras (the worker's slots)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.names: set[str] = set()

    def fits(self, request: Request) -> bool:
        if request.lora_name is None or request.lora_name in self.names:
            return True
        if len(self.names) < self.max_loras:
            self.names.add(request.lora_name)
            return True
        return False
