"""An answer in OpenAI's shapes: a whole completion, or a stream of server-sent events, from the
engine's choice deltas (generation.py); the completion and chat choice objects, logprobs included."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from pdserve.api.generation import Generation, generate_choices
from pdserve.api.state import APIError, ServerState
from pdserve.engine.engine_client import EngineError
from pdserve.engine.messages import TokenLogprobs
from pdserve.http.errors import error_body


async def complete(state: ServerState, body: Any, gen: Generation, params: Any, kind: str, make_choice: Any
                    ) -> JSONResponse:
    texts = [""] * body.n
    tokens: list[list[int]] = [[] for _ in range(body.n)]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(body.n)]
    try:
        async for d in generate_choices(state.engine, state.tokenizer, gen, params, body.n):
            texts[d.index] += d.text
            tokens[d.index] += d.token_ids
            logprobs[d.index] += d.logprobs
    except asyncio.CancelledError:  # the client went away (_until_disconnect); the engine requests are aborted
        state.metrics.request_finished(gen, "abort")
        raise
    except EngineError as e:
        state.metrics.request_finished(gen, "error")
        raise APIError(str(e), 500, e.err_type) from None
    except ValueError as e:
        state.metrics.request_finished(gen, "error")
        raise APIError(str(e)) from None
    state.metrics.request_finished(gen)
    choices = [make_choice(state, i, texts[i], tokens[i], logprobs[i], gen.finish_reasons.get(i), params, False)
               for i in range(body.n)]
    out = {"id": gen.request_id, "object": kind, "created": int(gen.created), "model": state.model_name,
           "choices": choices, "usage": gen.usage()}
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
            self.state.metrics.request_finished(self.gen, outcome)


async def stream(state: ServerState, body: Any, gen: Generation, params: Any, kind: str, make_choice: Any,
                  release: StreamRelease) -> AsyncIterator[str]:
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def event(choices: list[dict], usage: dict | None = None) -> str:
        data: dict = {"id": gen.request_id, "object": chunk_kind, "created": int(gen.created),
                      "model": state.model_name, "choices": choices}
        if include_usage:
            data["usage"] = usage
        if body.collect_metrics:
            data["metrics"] = gen.metrics()
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    outcome = None
    try:
        if kind == "chat.completion":
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(body.n)])
        async for d in generate_choices(state.engine, state.tokenizer, gen, params, body.n):
            if d.text or d.finish_reason is not None or d.logprobs:
                yield event([make_choice(state, d.index, d.text, d.token_ids, d.logprobs, d.finish_reason,
                                         params, True)])
        if include_usage:
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


def completion_choice(state: ServerState, index: int, text: str, token_ids: list[int], logprobs: list,
                       finish: str | None, params: Any, stream: bool) -> dict:
    choice: dict = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    if params.logprobs is not None:
        tok = state.tokenizer.token_text
        choice["logprobs"] = {
            "tokens": [tok(t) for t in token_ids],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{tok(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
                             for lp in logprobs],
            "text_offset": [],
        }
    return choice


def chat_choice(state: ServerState, index: int, text: str, token_ids: list[int], logprobs: list,
                 finish: str | None, params: Any, stream: bool) -> dict:
    key = "delta" if stream else "message"
    body: dict = {"content": text} if stream else {"role": "assistant", "content": text}
    choice: dict = {"index": index, key: body, "finish_reason": finish, "logprobs": None}
    if params.logprobs is not None:
        tok = state.tokenizer.token_text

        def entry(t: int, v: float) -> dict:
            s = tok(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        choice["logprobs"] = {"content": [
            {**entry(t, lp.logprob), "top_logprobs": [entry(a, b) for a, b in zip(lp.top_token_ids, lp.top_logprobs,
                                                                                  strict=True)]}
            for t, lp in zip(token_ids, logprobs, strict=True)]}
    return choice
