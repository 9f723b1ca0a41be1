"""One API request as n engine requests: text deltas, stop strings, logprobs, usage and timings."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.api.async_engine import AsyncEngine
from pdserve.engine.engine_client import EngineError
from pdserve.engine.messages import PDParams, RequestTimes
from pdserve.engine.prefix_pull import PullHint
from pdserve.sampling import SamplingParams
from pdserve.tokenization.detokenizer import IncrementalDetokenizer
from pdserve.tokenization.tokenizer import Tokenizer
from pdserve.worker.protocol import TokenLogprobs


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first delta, when asked for


@dataclass
class AnswerShape:
    """What the answer carries besides generated text."""

    tool_parser: Callable[[], Any] | None = None  # chat with tools: reads tool calls back from the text
    tools_forced: bool = False  # tool_choice required or named: the answer is calls only
    echo: bool = False  # completions: the prompt's text (and logprobs) first
    return_generated: bool = True  # False: echo with max_tokens 0 (one token is computed, none returned)
    echo_text: str | None = None  # the prompt as the client wrote it (echoed as is; token prompts are decoded)
    max_tool_calls: int | None = None  # parallel_tool_calls false: the first call only
    prompt_logprobs_field: bool = False  # the client sent prompt_logprobs: answer vLLM's field


@dataclass
class Generation:
    """Running totals of one API request across its choices."""

    request_id: str
    prompt_token_ids: list[int]
    created: float = field(default_factory=time.time)
    completion_tokens: int = 0
    num_cached_tokens: int = 0
    times: dict[int, RequestTimes] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    pd: PDParams | None = None  # a PD request: each choice i is transfer `{transfer_id}-{i}`
    shape: AnswerShape = field(default_factory=lambda: AnswerShape())
    # A stream the router may move (its `migration` field): events name their token ids. A resumed
    # one continues after `resumed`, the tokens an earlier instance streamed (`resumed_text`).
    report_tokens: bool = False
    resumed: list[int] = field(default_factory=list)
    resumed_text: str = ""
    priority: int = 0  # the request's `priority` (--scheduling-policy priority)
    admitted: Any = None  # api/admission.Admitted when --ttft-slo-ms / --rate-limit let it in
    lora_name: str | None = None  # the LoRA adapter its `model` named
    kv_pull: PullHint | None = None  # the router's `kv_pull`: a peer to pull the prompt's prefix from
    trace: Any = None  # api/tracing.RequestSpan: its trace is sampled (--otlp-traces-endpoint)

    def resume_after(self, token_ids: list[int], text: str) -> None:
        self.resumed, self.resumed_text = list(token_ids), text
        self.completion_tokens = len(token_ids)

    def usage(self) -> dict:
        """A resumed answer's prefix-cache hits may cover the tokens it resumed after: at most the prompt."""
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": min(self.num_cached_tokens, prompt)}}

    def latencies(self) -> tuple[float | None, float | None]:
        """The first choice's TTFT and mean inter-token latency, in seconds (None: it had no such thing)."""
        t = self.times.get(0)
        if t is None or t.first_token is None:
            return None, None
        itl = None
        if t.last_token is not None and self.completion_tokens > 1:
            itl = (t.last_token - t.first_token) / (self.completion_tokens - 1)
        return t.first_token - t.arrival, itl

    def metrics(self) -> dict:
        """Server timestamps (unix seconds) of the first choice, plus seconds since arrival now."""
        t = self.times.get(0)
        out: dict = {"arrival_time": time.time() - self.created}
        if t is not None:
            out.update(arrival=t.arrival, queued=t.arrival, prefill_start=t.first_scheduled,
                       first_token=t.first_token, last_token=t.last_token, finished=t.finished)
            pd_times = {"preallocated": t.preallocated, "cache_info_sent": t.cache_info_sent,
                        "first_layer_written": t.first_layer_written, "last_layer_written": t.last_layer_written,
                        "prefill_done_received": t.prefill_done_received, "buffered": t.buffered,
                        "swap_started": t.swap_started, "swapped_in": t.swapped_in}
            out.update({k: v for k, v in pd_times.items() if v is not None})
            if t.kv_bytes is not None:  # the prompt KV this decode instance received, and over what
                out.update(kv_bytes=t.kv_bytes, kv_protocol=t.kv_protocol)
        return out


async def generate_choices(engine: AsyncEngine, tokenizer: Tokenizer, gen: Generation, params: SamplingParams,
                           n: int) -> AsyncIterator[ChoiceDelta]:
    """Deltas of the n choices, interleaved as they come. Leaving early aborts what still runs."""
    queue: asyncio.Queue[ChoiceDelta | Exception | None] = asyncio.Queue()
    eos = list(tokenizer.eos_token_ids)
    trace_steps = gen.trace is not None and gen.trace.detailed

    async def one(index: int) -> None:
        sub = params if n == 1 else msgspec.structs.replace(
            params, seed=None if params.seed is None else params.seed + index)
        detok = IncrementalDetokenizer(tokenizer, sub)
        detok.add(gen.resumed)  # a resumed answer: its text so far is settled as it was where it began
        pd = None if gen.pd is None else msgspec.structs.replace(gen.pd, transfer_id=f"{gen.pd.transfer_id}-{index}")
        prompt = gen.prompt_token_ids + gen.resumed
        engine_id = f"{gen.request_id}-{index}" + (f"-{uuid.uuid4().hex[:8]}" if gen.resumed else "")
        try:
            async for out in engine.generate(engine_id, prompt, sub, eos, pd, len(gen.resumed), gen.priority,
                                             gen.lora_name, gen.kv_pull, trace_steps):
                if out.error is not None:  # 400s are the request's fault; the rest the engine's
                    raise (ValueError(out.error) if out.error_status == 400
                           else EngineError(out.error, out.error_type or "internal_server_error"))
                text = detok.add(out.new_token_ids)
                used = detok.num_used  # a stop string may end the answer before the last of them
                gen.completion_tokens += used
                finish = out.finish_reason
                if detok.stopped:
                    finish = "stop"
                elif finish is not None:
                    text += detok.finish()
                if out.times is not None:
                    gen.times[index] = out.times
                    if index == 0:
                        gen.num_cached_tokens = out.num_cached_tokens
                await queue.put(ChoiceDelta(index, text, out.new_token_ids[:used], (out.new_logprobs or [])[:used],
                                            finish, out.prompt_logprobs))
                if finish is not None:
                    gen.finish_reasons[index] = finish
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    try:
        running = n
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

