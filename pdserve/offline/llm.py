"""Offline batch generation, shaped like vLLM's `LLM` so users' scripts carry over.

    from pdserve import LLM, SamplingParams
    llm = LLM()  # the embedded model; any engine flag as a keyword (max_num_seqs=..., ...)
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

The engine and its worker run in child processes; they end when the LLM is closed (or used as a
context manager, or garbage-collected).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.config.engine import EngineConfig
from pdserve.config.lora import LoRARequest
from pdserve.engine.engine_client import EngineClient
from pdserve.engine.messages import CheckIdle, GetStats, LoadLoRA
from pdserve.engine.messages import RequestOutput as EngineOutput
from pdserve.engine.stats import EngineStats
from pdserve.loader import model_name, resolve_model_folder, tensor_parallel_refusal
from pdserve.offline.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pdserve.sampling import SamplingParams
from pdserve.tokenization.detokenizer import IncrementalDetokenizer
from pdserve.tokenization.tokenizer import Tokenizer

Prompt = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} / {"prompt": "..."}
Conversation = list[dict[str, Any]]


@dataclass
class _Pending:
    output: RequestOutput
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool


class LLM:
    def __init__(self, model: str | None = None, **engine_flags: Any) -> None:
        self.config = EngineConfig(model=str(model) if model is not None else None, **engine_flags)
        self.tokenizer = Tokenizer(resolve_model_folder(model))  # converts a GGUF once, before the worker starts
        if refusal := tensor_parallel_refusal(model, self.config.tensor_parallel_size):  # before any process
            raise ValueError(refusal)
        self.engine = EngineClient(self.config, model_name(model))
        self._finalizer = weakref.finalize(self, self.engine.close)
        self._ids = itertools.count()
        self._loras = {m.name: m.path for m in self.config.lora_modules}  # adapters the engine has

    # ---- public API ----------------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base) per prompt; an adapter
        not loaded yet is loaded from its path first (LLM(enable_lora=True, ...))."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, sampling_params, use_tqdm, self._lora_names(lora_request, len(encoded)))

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params, use_tqdm, self._lora_names(lora_request, len(encoded)))

    def stats(self) -> EngineStats:
        """Engine counters: blocks, prefix-cache hits, computed tokens, preemptions (engine/stats.py)."""
        return self.engine.call(GetStats())

    def check_idle(self) -> EngineStats:
        """Debug check: with nothing in flight, every KV block is free. Raises if one leaked."""
        return self.engine.call(CheckIdle())

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])

    def _lora_names(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
                    ) -> list[str | None]:
        requests = [lora_request] * n if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(requests) != n:
            raise ValueError(f"got {n} prompts but {len(requests)} LoRA requests")
        for r in requests:
            if r is not None and r.lora_name not in self._loras:
                if not self.config.enable_lora:
                    raise ValueError("a LoRA request needs LLM(enable_lora=True, ...)")
                self.engine.call(LoadLoRA(r.lora_name, r.lora_path))
                self._loras[r.lora_name] = r.lora_path
        return [None if r is None else r.lora_name for r in requests]

    def _run(self, prompts: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
             loras: list[str | None] | None = None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        eos = list(self.tokenizer.eos_token_ids)
        results: list[RequestOutput] = []
        pending: dict[str, _Pending] = {}
        loras = loras or [None] * len(prompts)
        for (text, ids), params, lora in zip(prompts, params_list, loras, strict=True):
            out = RequestOutput(str(next(self._ids)), text, ids)
            results.append(out)
            for i in range(params.n):
                # Each of n samples is its own engine request; a seed is offset so samples differ.
                sub = msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                completion = CompletionOutput(i, "", [], None, 0.0 if params.logprobs is not None else None,
                                              [] if params.logprobs is not None else None)
                out.outputs.append(completion)
                rid = f"{out.request_id}-{i}"
                pending[rid] = _Pending(out, completion, IncrementalDetokenizer(self.tokenizer, sub),
                                        params.logprobs is not None)
                self.engine.add_request(rid, ids, sub, eos, lora_name=lora)
        progress = _progress(len(results), use_tqdm)
        try:
            while pending:
                for eo in self.engine.get_outputs():
                    state = pending.get(eo.request_id)
                    if state is None:  # e.g. the abort answer for a request a stop string ended
                        continue
                    if self._apply(state, eo):
                        del pending[eo.request_id]
                        if all(c.finish_reason is not None for c in state.output.outputs):
                            state.output.finished = True
                            progress.update(1)
        except BaseException:
            if self.engine.alive():
                self.engine.abort(list(pending))
            raise
        finally:
            progress.close()
        return results

    def _apply(self, state: _Pending, eo: EngineOutput) -> bool:
        """Fold one engine output into the completion; True once the completion is finished."""
        c = state.completion
        if eo.error is not None:
            self.engine.abort([f"{state.output.request_id}-{i}" for i in range(len(state.output.outputs))])
            raise ValueError(eo.error)
        state.detokenizer.add(eo.new_token_ids)
        used = state.detokenizer.num_used  # a stop string may end the answer before the last of them
        c.token_ids.extend(eo.new_token_ids[:used])
        if state.want_logprobs and eo.new_logprobs:
            for token, lp in zip(eo.new_token_ids[:used], eo.new_logprobs[:used], strict=True):
                entry = {token: Logprob(lp.logprob, self.tokenizer.token_text(token))}
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
                    entry.setdefault(t, Logprob(v, self.tokenizer.token_text(t)))
                c.logprobs.append(entry)
                c.cumulative_logprob += lp.logprob
        c.text = state.detokenizer.text
        if state.detokenizer.stopped and eo.finish_reason is None:
            self.engine.abort([f"{state.output.request_id}-{c.index}"])
            c.finish_reason = "stop"
        elif eo.finish_reason is not None:
            state.detokenizer.finish()
            c.text = state.detokenizer.text
            c.finish_reason = "stop" if state.detokenizer.stopped else eo.finish_reason
        else:
            return False
        if eo.num_prompt_tokens:
            state.output.num_cached_tokens = eo.num_cached_tokens
        if eo.times is not None:
            t = eo.times
            state.output.metrics = RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.last_token,
                                                  t.finished)
        return True


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="prompt", disable=not enabled or total <= 1, dynamic_ncols=True)
