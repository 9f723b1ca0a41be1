"""The worker: one per tensor-parallel rank. Owns weights, the per-request sampling state and the KV
cache where it creates it: in mixed role, and in every role when the cache is in device memory (then
it copies KV through the cache service's host segments, kv_copier.py); with a CPU cache in PD roles the
cache service creates a shared segment and the worker attaches. Executes the steps the engine sends."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import psutil
import torch
import zmq

from pdserve.config.engine import EngineConfig
from pdserve.kv.cache import KVCache
from pdserve.kv.transfer_plan import LayerDone, StepTransfers
from pdserve.model import SequenceChunk
from pdserve.model.tensor_parallel import TensorParallel
from pdserve.sampling import SamplerOutput, SamplingRow, make_generator, skip_draws
from pdserve.spec_decode.verifier import accepted_tokens, position_rows, rewind
from pdserve.structured.matcher import GrammarCompiler, SequenceGrammar, allowed_tokens
from pdserve.worker.calibration import time_steps
from pdserve.worker.kv_copier import CopyEvent, KVCopier
from pdserve.worker.layer_announcer import LayerAnnouncer
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.profile_run import profile_num_blocks
from pdserve.worker.protocol import (
    DEVICE,
    BlockCopy,
    CacheCommand,
    CalibrateCommand,
    Calibration,
    Chunk,
    ExecuteStep,
    LoRACommand,
    NewRequest,
    PromptLogprobs,
    Sampled,
    StepResult,
    TokenLogprobs,
    WeightsCommand,
    WorkerLoaded,
    WorkerOk,
    WorkerReady,
)

log = logging.getLogger("pdserve.worker")
PROMPT_SLICE = 256  # prompt positions projected to logits at a time (prompt logprobs)


class KVCacheTooSmall(ValueError):
    pass


class Worker:
    """One tensor-parallel rank (the only one when --tensor-parallel-size is 1). Every rank runs every step's
    forward pass on its heads; rank 0 alone projects to logits, samples and keeps the sampling state."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context | None = None, tp: TensorParallel | None = None
                 ) -> None:
        self.config = config
        self.ctx = ctx
        self.tp = tp or TensorParallel()
        before = psutil.Process().memory_info().rss
        self.runner = ModelRunner(config.model, dtype=config.dtype, device=config.device,
                                  block_size=config.block_size, max_model_len=config.max_model_len,
                                  quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype, tp=self.tp,
                                  max_loras=config.max_loras if config.enable_lora else 0,
                                  max_lora_rank=config.max_lora_rank,
                                  one_block_table_reason=config.one_block_table_reason())
        for module in config.lora_modules:  # a bad one stops the startup, naming it (AdapterError)
            self.runner.add_adapter(module.name, module.path)
        self.weights_resident = psutil.Process().memory_info().rss - before  # what loading the weights took
        self.profile: dict = {}
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
        else:
            result = profile_num_blocks(self.runner, config)
            self.profile = result.as_dict()
            num_blocks = result.num_blocks
        self._check_fits(num_blocks)
        self.layout = self.runner.layout(num_blocks)  # the instance's (every KV head); this rank views its share
        self._places = self.layout.places()  # a model layer's (group, slot)
        self.rows: dict[str, SamplingRow] = {}
        self.grammar_compiler = GrammarCompiler(self.runner.folder / "tokenizer.json", self.runner.config.vocab_size)
        self._cache_command: CacheCommand | None = None
        self._shared: KVCache | None = None  # the instance's shared segment, CPU (rank_view of it is the cache)
        self._messager: zmq.Socket | None = None
        self._announcer: LayerAnnouncer | None = None  # cache in device memory: signals after the copies
        self.host: dict[str, KVCache] = {}  # cache in device memory: this rank's share of the service's segments
        self._mapped: list[KVCache] = []  # the whole segments the views above (and a shared cache) are of
        self.copier: KVCopier | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._step_id = 0

    def loaded_message(self) -> WorkerLoaded:
        return WorkerLoaded(self.layout, self.runner.max_model_len, self.runner.config.vocab_size,
                            self.profile, self.weights_resident)

    def setup_cache(self, command: CacheCommand) -> WorkerReady:
        self._cache_command = command
        if command.num_blocks is not None:  # kept for a reload after clear_load_weight
            self.layout = self.layout.with_blocks(command.num_blocks)
        self._open_cache()
        for segment in command.host_segments:
            whole = KVCache.attach_shared(self.layout.with_blocks(segment.num_blocks), segment.name)
            self._mapped.append(whole)
            self.host[segment.role] = whole.rank_view(self.tp.rank, self.tp.size)
        if command.private:
            self.copier = KVCopier(lambda: self.runner.kv_cache, self.host, self.runner.device)
        if command.messager_address is not None and command.private:
            assert self.ctx is not None
            self._announcer = LayerAnnouncer(self.ctx, command.messager_address)
        elif command.messager_address is not None:
            assert self.ctx is not None
            self._messager = self.ctx.socket(zmq.PUSH)
            self._messager.setsockopt(zmq.LINGER, 0)
            self._messager.setsockopt(zmq.SNDTIMEO, 2000)  # a dead messager fails the step, not hangs it
            self._messager.connect(command.messager_address)
        layout = self.layout
        where = "created in device memory" if command.private else "created"
        log.info("KV cache %s: %d blocks = %d tokens, room for %d max-length (%d-token) requests%s%s",
                 where if command.create else f"attached ({command.segment})", layout.num_blocks,
                 layout.num_blocks * self.config.block_size, layout.num_blocks // self._blocks_per_request(),
                 self.runner.max_model_len, self._groups_text(),
                 "".join(f"; {s.role} {s.name} ({s.num_blocks} blocks)" for s in command.host_segments))
        return WorkerReady(num_blocks=layout.num_blocks, max_model_len=self.runner.max_model_len,
                           vocab_size=self.runner.config.vocab_size, kv_cache_name=self._segment_name(),
                           profile=self.profile)

    def _segment_name(self) -> str | None:
        return self._shared.shm_name if self._shared is not None else None

    def _open_cache(self) -> None:
        """This rank's cache: its own in device memory, or its heads' view of the instance's shared segment
        (which rank 0 creates in mixed role, the other ranks attaching after it)."""
        command = self._cache_command
        assert command is not None
        self._shared = None
        if command.private:
            self.runner.kv_cache = KVCache.allocate(self.layout.rank_share(self.tp.size), self.runner.device)
            return
        if self.runner.device.type != "cpu":
            raise ValueError(f"the startup plan put the KV cache in shared host memory, but this worker's device is "
                             f"{self.runner.device}; a device cache takes the staging path (pass --device to choose)")
        if command.create:
            self._shared = KVCache.create_shared(self.layout)
        else:
            self._shared = KVCache.attach_shared(self.layout, command.segment)
        self.runner.kv_cache = self._shared.rank_view(self.tp.rank, self.tp.size)

    def calibrate(self, command: CalibrateCommand, run: Callable[[Callable[[], object]], object] | None = None
                  ) -> Calibration:
        """`run`: how each timed step runs (the core loan's, under launch)."""
        return time_steps(self.runner, command, self.tp.rank == 0, run)

    def lora(self, command: LoRACommand) -> WorkerOk:
        """Load or unload an adapter (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)."""
        if command.action == "load":
            self.runner.add_adapter(command.name, command.path)
        elif command.action == "unload":
            self.runner.remove_adapter(command.name)
        else:
            raise ValueError(f"unknown LoRA action {command.action!r}")
        return WorkerOk(self._segment_name())

    def weights(self, command: WeightsCommand) -> WorkerOk:
        """Free the weights and this worker's cache mapping (the segment itself when the worker owns
        it, i.e. in mixed role), or load them again."""
        if command.action == "clear":
            self.rows.clear()
            self.runner.release()
            if self._shared is not None:
                self._shared.close()
                self._shared = None
        elif command.action == "load":
            if self.runner.model is None:
                self.runner.load_model()
                if command.segment is not None:  # a rank after the first: the segment rank 0 made again
                    self._cache_command = msgspec.structs.replace(self._cache_command, segment=command.segment)
                self._open_cache()
        else:
            raise ValueError(f"unknown weights action {command.action!r}")
        return WorkerOk(self._segment_name())

    def execute(self, step: ExecuteStep) -> StepResult:
        if self.tp.rank > 0:
            return self._execute_share(step)
        for request_id in step.finished_ids:
            self.rows.pop(request_id, None)
        for new in step.new_requests:
            self.rows[new.request_id] = self._row(new)
        if self._announcer is not None and self._announcer.error is not None:
            raise RuntimeError(self._announcer.error)
        copies_done = self._run_copies(step.copies)
        if not step.chunks:
            if copies_done:
                self.copier.synchronize()
            return StepResult(sampled=[], copies_done=copies_done)
        chunks = self._sequence_chunks(step.chunks)
        to_sample = [i for i, c in enumerate(step.chunks) if c.sample]
        speculating = [i for i in to_sample if step.chunks[i].num_draft]
        ids = [step.chunks[i].request_id for i in to_sample]
        rows = [self.rows[rid] for rid in ids]
        drafts = [c.token_ids[-c.num_draft:] if c.num_draft else [] for c in (step.chunks[i] for i in to_sample)]
        grammars = [r.grammar for r in rows]
        masks = (self.grammar_compiler.fill_async(grammars, drafts if speculating else None)
                 if any(g is not None for g in grammars) else None)
        scored = [i for i, c in enumerate(step.chunks) if self._wants_prompt_logprobs(c)]
        logits, prompt_logits = self.runner.logits_with_prompt(chunks, scored, self._stream_layers(step), speculating)
        if self.copier is not None:  # this step's copies (its own and the engine's) complete before it reports
            self.copier.synchronize()
        prompt_logprobs = [self._prompt_logprobs(step.chunks[i], prompt_logits[i]) for i in scored]
        if not to_sample:
            return StepResult(sampled=[], prompt_logprobs=prompt_logprobs, copies_done=copies_done)
        if len(to_sample) < len(chunks):
            logits = logits[torch.tensor(_sampled_rows(step.chunks, to_sample), device=logits.device)]
        bits = masks.result() if masks is not None else None
        grammar_mask = allowed_tokens(bits, logits.shape[1], logits.device) if bits is not None else None
        # a seeded speculating sequence draws for every position; its generator is put back after (rewind)
        states = [r.generator.get_state() if d and r.generator is not None else None
                  for r, d in zip(rows, drafts, strict=True)]
        flat_rows = [p for row, proposed in zip(rows, drafts, strict=True) for p in position_rows(row, proposed)]
        out = self.runner.sampler(logits, flat_rows, grammar_mask)
        return StepResult(sampled=self._accept(ids, rows, drafts, out, states), prompt_logprobs=prompt_logprobs,
                          copies_done=copies_done)

    def _execute_share(self, step: ExecuteStep) -> StepResult:
        """A rank after the first: the step's copies and forward pass on its heads, nothing to sample."""
        if self._announcer is not None and self._announcer.error is not None:
            raise RuntimeError(self._announcer.error)
        copies_done = self._run_copies(step.copies)
        if step.chunks:
            chunks = self._sequence_chunks(step.chunks)
            speculating = [i for i, c in enumerate(step.chunks) if c.sample and c.num_draft]  # as rank 0 projects
            self.runner.forward_only(chunks, self._stream_layers(step), speculating)
        if self.copier is not None:
            self.copier.synchronize()
        return StepResult(sampled=[], copies_done=copies_done)

    def _sequence_chunks(self, chunks: list[Chunk]) -> list[SequenceChunk]:
        """The step's chunks for the model, each with its LoRA adapter's slot (placed for this step)."""
        slots = self.runner.lora_slots_for([c.lora for c in chunks])
        return [SequenceChunk(c.token_ids, c.num_computed, c.block_table, slot, c.group_tables)
                for c, slot in zip(chunks, slots, strict=True)]

    def _run_copies(self, copies: list[BlockCopy]) -> list[int]:
        """Launch the engine's block copies, in order; the forward pass after them sees what they copied
        into the cache (the compute stream waits for them, on CUDA without a host sync, so they overlap
        what comes before it). Their ids are reported once the step has synchronized the copier."""
        if not copies:
            return []
        if self.copier is None:
            raise RuntimeError("block copies were sent to a worker whose cache is in shared memory")
        for c in copies:
            event = self.copier.copy(c.src, c.dst, c.src_blocks, c.dst_blocks)
            if c.dst == DEVICE:
                self.copier.device_waits(event)
        return [c.copy_id for c in copies]

    def _accept(self, ids: list[str], rows: list[SamplingRow], drafts: list[list[int]], out: SamplerOutput,
                states: list[torch.Tensor | None]) -> list[Sampled]:
        """Per sequence, the tokens it emits (with proposals: accepted_tokens), into its sampling state."""
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        sampled, offset = [], 0
        for rid, row, proposed, state in zip(ids, rows, drafts, states, strict=True):
            emitted = accepted_tokens(tokens[offset:offset + 1 + len(proposed)], proposed)
            if state is not None:
                rewind(row.generator, state, len(emitted))
            row.output_token_ids.extend(emitted)
            if row.grammar is not None:
                for token in emitted:
                    row.grammar.advance(token)
            lps = None
            if row.params.logprobs is not None and logprobs is not None:
                k = row.params.logprobs
                lps = [TokenLogprobs(logprobs[j], top_ids[j][:k] if top_ids else [], top_lps[j][:k] if top_lps else [])
                       for j in range(offset, offset + len(emitted))]
            error = row.grammar.error if row.grammar is not None else None
            sampled.append(Sampled(rid, emitted, lps, error))
            offset += 1 + len(proposed)
        return sampled

    def _row(self, new: NewRequest) -> SamplingRow:
        split = len(new.prompt_token_ids) - new.num_resumed  # a migrated answer's output came in the prompt
        outputs = new.prompt_token_ids[split:] + list(new.output_token_ids)
        row = SamplingRow(new.params, new.prompt_token_ids[:split], outputs, tuple(new.eos_token_ids),
                          make_generator(new.params.seed, self.runner.device))
        if row.generator is not None:  # tokens sampled before (by P, another instance, a preemption) drew
            skip_draws(row.generator, len(outputs))
        device = self.runner.device
        if row.bias is not None:
            row.bias = (row.bias[0].to(device), row.bias[1].to(device))
        if row.allowed is not None:
            row.allowed = row.allowed.to(device)
        if new.params.structured is not None:  # compiled on the mask thread, at its first mask
            row.grammar = SequenceGrammar(new.params.structured, new.eos_token_ids, outputs)
        return row

    def _wants_prompt_logprobs(self, chunk: Chunk) -> bool:
        """A chunk of a prompt_logprobs request that covers prompt tokens not scored yet (a recompute
        after preemption covers scored ones again)."""
        row = self.rows[chunk.request_id]
        if row.params.prompt_logprobs is None:
            return False
        unscored = row.prompt_scored < len(row.prompt_token_ids) - 1
        return unscored and chunk.num_computed + len(chunk.token_ids) > row.prompt_scored

    def _prompt_logprobs(self, chunk: Chunk, hidden: torch.Tensor) -> PromptLogprobs:
        """The hidden state at position p scores prompt token p + 1. Projected PROMPT_SLICE rows at a
        time: a 2,048-token chunk never holds [2,048, vocab] logits (0.4 GB at this vocab, 1.2 GB at 150k)."""
        row = self.rows[chunk.request_id]
        prompt, start, k = row.prompt_token_ids, chunk.num_computed, row.params.prompt_logprobs
        first, end = max(start, row.prompt_scored), min(start + len(chunk.token_ids), len(prompt) - 1)
        entries = []
        for a in range(first, end, PROMPT_SLICE):
            b = min(a + PROMPT_SLICE, end)
            logprobs = torch.log_softmax(self.runner.project(hidden[a - start:b - start]), dim=-1)
            targets = torch.tensor(prompt[a + 1:b + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
            top_lps, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            tops = zip(top_ids.tolist(), top_lps.tolist(), strict=True) if k else (([], []) for _ in ranks)
            for lp, rank, (ids, lps) in zip(chosen.squeeze(1).tolist(), ranks, tops, strict=True):
                entries.append(TokenLogprobs(lp, ids, lps, rank))
        row.prompt_scored = end
        return PromptLogprobs(chunk.request_id, first + 1, entries)

    def _stream_layers(self, step: ExecuteStep):  # noqa: ANN202 - Callable[[int], None] | None
        """Prefill role: tell the cache messager what this step sends, then each layer as it is done."""
        if step.transfers and self._announcer is not None:
            return self._stage_layers(step)
        if not step.transfers or self._messager is None:
            return None
        self._step_id += 1
        step_id, sock, encode, rank = self._step_id, self._messager, self._encoder.encode, self.tp.rank
        sock.send(encode(StepTransfers(step_id, step.transfers)))
        return lambda layer: sock.send(encode(LayerDone(step_id, layer, rank)))

    def _stage_layers(self, step: ExecuteStep):  # noqa: ANN202 - Callable[[int], None]
        """Prefill role, cache in device memory: as each layer is done, copy its new blocks device ->
        staging (the same block ids: staging mirrors the cache), and signal the layer once the copy has
        completed. Prefix-cache hits (whole blocks, sent with layer 0) are copied with layer 0."""
        self._step_id += 1
        step_id, announcer, encode, copier = self._step_id, self._announcer, self._encoder.encode, self.copier
        announcer.send(encode(StepTransfers(step_id, step.transfers)))
        by_group = list(zip(*(plan.groups for plan in step.transfers), strict=True))  # a layer's blocks: its group's
        whole = [b for group in by_group for p in group for b in p.src_blocks[:p.num_whole_blocks]]
        computed = [[b for p in group for b in p.src_blocks[p.num_whole_blocks:]] for group in by_group]
        places = self._places

        def layer_done(layer: int) -> None:
            events: list[CopyEvent] = []
            if layer == 0 and whole:
                events.append(copier.copy(DEVICE, "staging", whole, whole))
            group, slot = places[layer]
            if blocks := computed[group]:
                events.append(copier.copy(DEVICE, "staging", blocks, blocks, slot))
            announcer.send(encode(LayerDone(step_id, layer, self.tp.rank)), events)

        return layer_done

    def close(self) -> None:
        self.grammar_compiler.close()
        if self._messager is not None:
            self._messager.close()
        if self._announcer is not None:
            self._announcer.close()
        if self.copier is not None:
            self.copier.close()
        self.runner.release()
        for cache in [*self._mapped, *([self._shared] if self._shared is not None else [])]:
            cache.close()

    def _groups_text(self) -> str:
        """For a model with sliding-window layers: its layer groups, or why it keeps one block table."""
        groups = self.layout.layer_groups
        if groups is None:
            reason = self.config.one_block_table_reason() or "every layer attends alike"
            return f"; one block table for every layer ({reason})" if self.runner.config.has_windows else ""
        kinds = zip(groups.layers, groups.windows, strict=True)
        windows = ", ".join(f"{len(g)} layers {f'window {w}' if w else 'full'}" for g, w in kinds)
        return f"; a block table per layer group ({windows}), {self.layout.num_layers} layer slots a block"

    def _blocks_per_request(self) -> int:
        """The blocks one request of max_model_len holds (across the layer groups, where they have tables)."""
        groups = self.runner.layout(1).layer_groups
        if groups is None:
            return -(-self.runner.max_model_len // self.config.block_size)
        return groups.blocks_per_request(self.runner.max_model_len, self.config.block_size,
                                         self.config.max_num_batched_tokens)

    def _check_fits(self, num_blocks: int) -> None:
        needed = self._blocks_per_request()
        if num_blocks < needed:
            raise KVCacheTooSmall(
                f"the KV cache has room for {num_blocks} blocks ({num_blocks * self.config.block_size} tokens), "
                f"but one request of --max-model-len {self.runner.max_model_len} needs {needed} blocks; "
                "raise --kv-cache-memory or --gpu-memory-utilization (or --num-gpu-blocks-override), "
                "or lower --max-model-len or --max-num-batched-tokens")


def _sampled_rows(chunks: list[Chunk], to_sample: list[int]) -> list[int]:
    """Rows of the step's logits (one per chunk, 1 + num_draft for a speculating one) that are sampled."""
    starts, row = [], 0
    for c in chunks:
        starts.append(row)
        row += 1 + c.num_draft  # a chunk with proposals always samples
    return [r for i in to_sample for r in range(starts[i], starts[i] + 1 + chunks[i].num_draft)]

