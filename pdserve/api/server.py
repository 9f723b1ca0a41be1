"""The OpenAI-compatible HTTP server of one instance (FastAPI).

The engine runs in its own process; this process tokenizes, applies the chat template,
detokenizes incrementally, streams, and reports errors in the OpenAI format.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.async_engine import AsyncEngine
from pdserve.api.generation import Generation, generate_choices
from pdserve.api.metrics import ServerMetrics
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.registration import register_forever
from pdserve.engine.engine_client import EngineError
from pdserve.engine.messages import PDParams, TokenLogprobs
from pdserve.http.auth import bearer_auth
from pdserve.http.disconnect import until_disconnect
from pdserve.http.errors import error_body
from pdserve.tokenizer import Tokenizer

log = logging.getLogger("pdserve.serve")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    max_concurrency: int
    metrics: ServerMetrics
    in_flight: int = 0
    weights_cleared: bool = False
    router_url: str | None = None  # --router: register there every few seconds
    instance: dict | None = None  # what to register: role, url, control-plane address, transports
    api_key: str | None = None  # --api-key: /v1 requests must carry it as a Bearer token
    sampling_defaults: dict | None = None  # the model's generation_config values for omitted fields
    request_shutdown: Callable[[], None] | None = None  # stops the HTTP server (set by `pdserve serve`)
    exit_code: int = 0  # 1 once the engine died


def build_app(state: ServerState) -> FastAPI:
    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        tasks = [asyncio.create_task(_refresh_metrics(state)), asyncio.create_task(_exit_when_engine_dies(state))]
        if state.router_url and state.instance:
            tasks.append(asyncio.create_task(register_forever(state.router_url, state.instance)))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await state.engine.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)

    if state.api_key:
        app.middleware("http")(bearer_auth(state.api_key))

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.status, e.err_type, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            reason = (first.get("ctx") or {}).get("error", "JSON decode error")
            message = f"the request body is not valid JSON: {reason} (at character {first['loc'][-1]})"
            return JSONResponse(error_body(message, 400), status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(message, 400, param=".".join(loc) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.healthy:
            return JSONResponse(error_body(state.engine.error or "engine is down", 503, "service_unavailable"),
                                status_code=503)
        if state.weights_cleared:
            return JSONResponse(error_body("the model weights are cleared", 503, "service_unavailable"),
                                status_code=503)
        return Response(status_code=200)

    @app.api_route("/clear_load_weight", methods=["GET", "POST"])
    async def clear_load_weight() -> dict:
        """Free the weights and the KV cache (mixed role); requests get 503 until they are loaded again."""
        state.weights_cleared = True
        try:
            result = await state.engine.call("clear_weights", timeout=120)
        except EngineError as e:
            raise APIError(str(e), 500, "internal_server_error") from None
        return {"status": "cleared", **result}

    @app.api_route("/update_model_weight", methods=["GET", "POST"])
    async def update_model_weight() -> dict:
        """Load the weights from disk again and recreate the KV cache."""
        try:
            await state.engine.call("load_weights", timeout=600)
        except EngineError as e:
            raise APIError(str(e), 500, "internal_server_error") from None
        state.weights_cleared = False
        return {"status": "loaded"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return await state.metrics.render(state.engine)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        _check_model(state, body.model)
        prompt_ids = _completion_prompt(state, body)
        params = _sampling_params(state, body, body.max_tokens, body.logprobs)
        gen = Generation(f"cmpl-{next(ids)}", prompt_ids, pd=_pd_params(body))
        return await _respond(state, raw, body, gen, params, "text_completion", _completion_choice)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        _check_model(state, body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt_ids = state.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                **(body.chat_template_kwargs or {}))
        except Exception as e:  # the template raised on these messages
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
        _check_length(state, prompt_ids)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(state, body, max_tokens, logprobs)
        gen = Generation(f"chatcmpl-{next(ids)}", prompt_ids, pd=_pd_params(body))
        return await _respond(state, raw, body, gen, params, "chat.completion", _chat_choice)

    return app


async def _exit_when_engine_dies(state: ServerState, grace: float = 0.5) -> None:
    """An instance without its engine (or the engine's worker or cache service) cannot serve again: it
    stops, exit code 1, so that its supervisor (`pdserve launch`, systemd, Kubernetes) starts it afresh,
    as vLLM's server does. /health says 503 meanwhile; requests in flight get their errors first."""
    await state.engine.dead.wait()
    log.error("the engine died (%s): this instance stops (exit code 1) for its supervisor to restart it",
              state.engine.error)
    state.exit_code = 1
    await asyncio.sleep(grace)
    if state.request_shutdown is not None:
        state.request_shutdown()


async def _refresh_metrics(state: ServerState, period: float = 1.0) -> None:
    """The --metrics-port exporter (a thread) only reads the registry: keep its engine gauges current."""
    while True:
        await asyncio.sleep(period)
        await state.metrics.refresh(state.engine)


# ---- request handling ------------------------------------------------------------------------

def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", err_type="model_not_found")


def _check_length(state: ServerState, prompt_ids: list[int]) -> None:
    if not prompt_ids:
        raise APIError("the prompt is empty", param="prompt")
    if len(prompt_ids) >= state.max_model_len:
        raise APIError(f"the prompt has {len(prompt_ids)} tokens, but this model's maximum context length is "
                       f"{state.max_model_len} tokens", param="prompt")
    if any(not 0 <= t < state.tokenizer.vocab_size for t in prompt_ids):
        raise APIError("prompt token ids must be in [0, vocab size)", param="prompt")


def _completion_prompt(state: ServerState, body: CompletionRequest) -> list[int]:
    prompt = body.prompt_token_ids if body.prompt_token_ids is not None else body.prompt
    if prompt is None:
        raise APIError("either prompt or prompt_token_ids is required", param="prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise APIError("one prompt per request is supported; send several requests", param="prompt")
        prompt = prompt[0]
    ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    _check_length(state, ids)
    return ids


async def _respond(state: ServerState, raw: Request, body: Any, gen: Generation, params: Any, kind: str,
                   make_choice: Any) -> Any:
    if params.max_tokens is None:
        try:
            params = msgspec.structs.replace(params, max_tokens=max(state.max_model_len - len(gen.prompt_token_ids), 1))
        except ValueError as e:  # e.g. min_tokens above what the context leaves
            raise APIError(str(e)) from None
    elif len(gen.prompt_token_ids) + params.max_tokens > state.max_model_len:
        raise APIError(f"prompt ({len(gen.prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                       f"the maximum context length of {state.max_model_len}", param="max_tokens")
    if not state.engine.healthy:
        raise APIError(state.engine.error or "the engine is down", 503, "service_unavailable")
    if state.weights_cleared:
        raise APIError("the model weights are cleared; POST /update_model_weight loads them", 503,
                       "service_unavailable")
    if state.in_flight >= state.max_concurrency:
        raise APIError(f"too many requests in flight (--max-concurrency {state.max_concurrency}); retry later",
                       429, "rate_limit_exceeded")
    state.in_flight += 1
    state.metrics.request_started()
    if body.stream:
        release = _StreamRelease(state, gen)
        # The generator's `finally` releases the slot; the background task covers a client that left
        # before the first chunk, when the generator never started and so never reaches `finally`.
        return StreamingResponse(_stream(state, body, gen, params, kind, make_choice, release),
                                 media_type="text/event-stream", background=BackgroundTask(release))
    try:
        return await until_disconnect(raw, _complete(state, body, gen, params, kind, make_choice))
    finally:
        state.in_flight -= 1


async def _complete(state: ServerState, body: Any, gen: Generation, params: Any, kind: str, make_choice: Any
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


class _StreamRelease:
    """Gives back a streaming request's in-flight slot and records its outcome, exactly once."""

    def __init__(self, state: ServerState, gen: Generation) -> None:
        self.state, self.gen, self.done = state, gen, False

    async def __call__(self, outcome: str | None = None) -> None:
        if not self.done:
            self.done = True
            self.state.in_flight -= 1
            self.state.metrics.request_finished(self.gen, outcome)


async def _stream(state: ServerState, body: Any, gen: Generation, params: Any, kind: str, make_choice: Any,
                  release: _StreamRelease) -> AsyncIterator[str]:
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


def _pd_params(body: Any) -> PDParams | None:
    pd = body.pd
    return None if pd is None else PDParams(pd.transfer_id, pd.role, pd.prefill_addr, pd.transport)


def _sampling_params(state: ServerState, body: Any, max_tokens: int | None, logprobs: int | None) -> Any:
    try:
        return body.sampling_params(max_tokens, logprobs, state.sampling_defaults)
    except ValueError as e:  # a combination the field checks cannot see (min_tokens > max_tokens, ...)
        raise APIError(str(e)) from None


# ---- response shapes -------------------------------------------------------------------------

def _completion_choice(state: ServerState, index: int, text: str, token_ids: list[int], logprobs: list,
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


def _chat_choice(state: ServerState, index: int, text: str, token_ids: list[int], logprobs: list,
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
