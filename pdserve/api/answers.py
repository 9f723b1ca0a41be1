"""An answer in OpenAI's shapes: a whole completion, or a stream of server-sent events, from the
engine's choice deltas (generation.py); the completion and chat choice objects, logprobs, echoed
prompts and tool calls included.

A chat stream's first chunk (the assistant role) leaves with the first token, as vLLM's does: every
benchmark client takes the first chunk for the first token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from pdserve.api.generation import ChoiceDelta, Generation, generate_choices
from pdserve.api.state import APIError, ServerState
from pdserve.engine.engine_client import EngineError
from pdserve.http.errors import error_body
from pdserve.http.wire import TOKENS_COMMENT
from pdserve.tool_calling.parsers import ToolCall
from pdserve.worker.protocol import TokenLogprobs


@dataclass
class Choice:
    """One choice, gathered (whole answers) or as one delta (streams)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    call_offset: int = 0  # streams: the index of tool_calls[0] within the answer's calls
    first: bool = True  # the choice's first chunk (a whole answer is one)
    text_offset: int = 0  # completions logprobs: where this chunk's text starts in the whole answer


async def whole_answer_deltas(state: ServerState, gen: Generation, params: Any, n: int
                              ) -> AsyncIterator[ChoiceDelta]:
    """The deltas of an answer returned whole: its outcome recorded, failures raised as APIError."""
    try:
        async for d in generate_choices(state.engine, state.tokenizer, gen, params, n):
            yield d
    except asyncio.CancelledError:  # the client went away (_until_disconnect); the engine requests are aborted
        state.request_finished(gen, "abort")
        raise
    except EngineError as e:
        state.request_finished(gen, "error")
        raise APIError(str(e), 500, e.err_type) from None
    except ValueError as e:
        state.request_finished(gen, "error")
        raise APIError(str(e)) from None
    state.request_finished(gen)


async def complete(state: ServerState, body: Any, gen: Generation, params: Any, kind: str, make_choice: Any
                    ) -> JSONResponse:
    choices = [Choice(i) for i in range(body.n)]
    async for d in whole_answer_deltas(state, gen, params, body.n):
        c = choices[d.index]
        if d.prompt_logprobs is not None:
            c.prompt_logprobs = d.prompt_logprobs
        if gen.shape.return_generated:
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs
    for c in choices:
        c.finish_reason = gen.finish_reasons.get(c.index)
        if gen.shape.tool_parser is not None:
            content, calls = gen.shape.tool_parser().parse(c.text)
            calls = calls[:gen.shape.max_tool_calls] if gen.shape.max_tool_calls is not None else calls
            if calls:
                c.text, c.tool_calls = content or "", calls
                c.finish_reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
    if not gen.shape.return_generated:
        gen.completion_tokens = 0
    out = {"id": gen.request_id, "object": kind, "created": int(gen.created),
           "model": gen.lora_name or state.model_name,
           "choices": [make_choice(state, gen, c, params, False) for c in choices], "usage": gen.usage()}
    if kind == "chat.completion" and gen.shape.prompt_logprobs_field:
        out["prompt_logprobs"] = _vllm_prompt_logprobs(state, gen, choices[0].prompt_logprobs)
    if body.collect_metrics:
        out["metrics"] = gen.metrics()
    return JSONResponse(out)


class StreamRelease:
    """Gives back a streaming request's in-flight slot and records its outcome, exactly once."""

    def __init__(self, state: ServerState, gen: Generation) -> None:
        self.state, self.gen, self.done = state, gen, False

    async def __call__(self, outcome: str | None = None) -> None:
        if not self.done:
            self.done = True
            self.state.in_flight -= 1
            self.state.request_finished(self.gen, outcome)


class _StreamedChoice:
    """Per-choice state of a stream: whether its first chunk went out, its tool-call parser."""

    def __init__(self, gen: Generation) -> None:
        self.started = False
        self.parser = gen.shape.tool_parser() if gen.shape.tool_parser is not None else None
        self.num_calls = 0
        self.text_offset = 0
        self.unreported: list[int] = []  # token ids since the last event (Generation.report_tokens)

    def resume(self, state: ServerState, gen: Generation) -> None:
        """A resumed answer: its first chunk, echo and tool calls so far went out from another instance."""
        self.started = True
        if self.parser is not None:
            self.num_calls = len(self.parser.feed(gen.resumed_text)[1])
        # completions logprobs: offsets count token strings, echoed prompt tokens first
        shown = ([*gen.prompt_token_ids, *gen.resumed] if gen.shape.echo else gen.resumed)
        self.text_offset = sum(len(state.tokenizer.token_text(t)) for t in shown)

    def tokens_comment(self, gen: Generation) -> str:
        """The SSE comment naming the token ids this event carries (for the router), or ""."""
        if not gen.report_tokens:
            return ""
        ids, self.unreported = self.unreported, []
        return f"{TOKENS_COMMENT.decode()} {' '.join(map(str, ids))}\n"

    def pieces(self, gen: Generation, d: ChoiceDelta) -> tuple[str, list[ToolCall]]:
        if self.parser is None:
            return d.text, []
        text, calls = self.parser.feed(d.text)
        if d.finish_reason is not None:
            text += self.parser.finish()
        if (self.num_calls or calls) and not text.strip():
            text = ""  # the newlines between calls are not content
        limit = gen.shape.max_tool_calls
        if limit is not None:
            calls = calls[:max(limit - self.num_calls, 0)]
        return text, calls


async def stream(state: ServerState, body: Any, gen: Generation, params: Any, kind: str, make_choice: Any,
                  release: StreamRelease) -> AsyncIterator[str]:
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options.continuous_usage_stats
    chat = kind == "chat.completion"

    def event(choices: list[dict], usage: dict | None = None, **extra: Any) -> str:
        data: dict = {"id": gen.request_id, "object": chunk_kind, "created": int(gen.created),
                      "model": gen.lora_name or state.model_name, "choices": choices, **extra}
        if include_usage:
            data["usage"] = gen.usage() if continuous and usage is None else usage
        if body.collect_metrics:
            data["metrics"] = gen.metrics()
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    outcome = None
    per_choice = [_StreamedChoice(gen) for _ in range(body.n)]
    if gen.resumed:
        per_choice[0].resume(state, gen)
    try:
        async for d in generate_choices(state.engine, state.tokenizer, gen, params, body.n):
            sc = per_choice[d.index]
            sc.unreported += d.token_ids
            text, calls = sc.pieces(gen, d)
            c = Choice(d.index, text, d.token_ids, list(d.logprobs), d.finish_reason, calls or None,
                       d.prompt_logprobs, call_offset=sc.num_calls, text_offset=sc.text_offset)
            sc.num_calls += len(calls)
            if c.finish_reason == "stop" and sc.num_calls:
                c.finish_reason = "tool_calls"
            if not gen.shape.return_generated:
                c.text, c.token_ids, c.logprobs = "", [], []
            first = c.first = not sc.started
            if first or c.text or c.finish_reason is not None or c.logprobs or c.tool_calls:
                sc.started = True
                choice = make_choice(state, gen, c, params, True)
                if not chat and choice["logprobs"] and choice["logprobs"]["tokens"]:
                    lp = choice["logprobs"]
                    sc.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
                if chat and first:
                    choice["delta"] = {"role": "assistant", **choice["delta"]}
                extra = {}
                if chat and c.prompt_logprobs is not None and gen.shape.prompt_logprobs_field:
                    extra["prompt_logprobs"] = _vllm_prompt_logprobs(state, gen, c.prompt_logprobs)
                yield sc.tokens_comment(gen) + event([choice], **extra)
        if include_usage:
            if not gen.shape.return_generated:
                gen.completion_tokens = 0
            yield event([], gen.usage())
        yield "data: [DONE]\n\n"
    except (EngineError, ValueError) as e:
        outcome = "error"
        if isinstance(e, EngineError):
            yield f"data: {json.dumps(error_body(str(e), 500, e.err_type))}\n\n"
        else:
            yield f"data: {json.dumps(error_body(str(e), 400))}\n\n"
    finally:  # also reached when the client disconnects: generate_choices then aborted its requests
        await release(outcome)


def completion_choice(state: ServerState, gen: Generation, c: Choice, params: Any, stream: bool) -> dict:
    text, token_ids, logprobs = c.text, c.token_ids, c.logprobs
    if gen.shape.echo and c.first:  # the prompt goes first: in the whole answer, or in a stream's first chunk
        prompt = gen.prompt_token_ids
        echoed = gen.shape.echo_text
        text = (echoed if echoed is not None else state.tokenizer.decode(prompt, skip_special_tokens=False)) + text
        token_ids = prompt + token_ids
        logprobs = [None, *(c.prompt_logprobs or [])] + logprobs
    choice: dict = {"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": None}
    if params.logprobs is not None:
        tok, k = state.tokenizer.token_text, params.logprobs
        strings = [tok(t) for t in token_ids]
        offsets, at = [], c.text_offset
        for s in strings:
            offsets.append(at)
            at += len(s)
        choice["logprobs"] = {
            "tokens": strings,
            "token_logprobs": [lp.logprob if lp is not None else None for lp in logprobs],
            "top_logprobs": [None if lp is None else {tok(t): v for t, v in zip(lp.top_token_ids[:k],
                                                                                lp.top_logprobs[:k], strict=True)}
                             for lp in logprobs],
            "text_offset": offsets,
        }
    if gen.shape.prompt_logprobs_field and c.prompt_logprobs is not None:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(state, gen, c.prompt_logprobs)
    return choice


def _vllm_prompt_logprobs(state: ServerState, gen: Generation, entries: list[TokenLogprobs] | None) -> list:
    """vLLM's shape: per prompt token (the first is null) {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return []
    tok = state.tokenizer.token_text
    out: list = [None]
    for token, lp in zip(gen.prompt_token_ids[1:], entries, strict=False):
        ranked = {t: (v, r + 1) for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True))}
        chosen = {str(token): {"logprob": lp.logprob, "rank": ranked.get(token, (None, lp.rank))[1],
                               "decoded_token": tok(token)}}
        out.append({**chosen, **{str(t): {"logprob": v, "rank": r, "decoded_token": tok(t)}
                                 for t, (v, r) in ranked.items() if t != token}})
    return out


def chat_choice(state: ServerState, gen: Generation, c: Choice, params: Any, stream: bool) -> dict:
    key = "delta" if stream else "message"
    body: dict = {"content": c.text} if stream else {"role": "assistant", "content": c.text}
    if c.tool_calls:
        if stream:
            body["tool_calls"] = [call.as_dict(i) for i, call in enumerate(c.tool_calls, start=c.call_offset)]
            if not c.text:
                body.pop("content")
        else:
            body["tool_calls"] = [call.as_dict() for call in c.tool_calls]
            body["content"] = c.text or None
    choice: dict = {"index": c.index, key: body, "finish_reason": c.finish_reason, "logprobs": None}
    if params.logprobs is not None:
        tok = state.tokenizer.token_text

        def entry(t: int, v: float) -> dict:
            s = tok(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        choice["logprobs"] = {"content": [
            {**entry(t, lp.logprob), "top_logprobs": [entry(a, b) for a, b in zip(lp.top_token_ids, lp.top_logprobs,
                                                                                  strict=True)]}
            for t, lp in zip(c.token_ids, c.logprobs, strict=True)]}
    return choice

