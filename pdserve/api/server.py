"""The OpenAI-compatible HTTP server of one instance (FastAPI).

The engine runs in its own process; this process tokenizes, applies the chat template,
detokenizes incrementally, streams, and reports errors in the OpenAI format.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.answers import StreamRelease, chat_choice, complete, completion_choice, stream
from pdserve.api.generation import AnswerShape, Generation
from pdserve.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenizeRequest,
    Tool,
)
from pdserve.api.registration import register_forever
from pdserve.api.responses_api import ResponsesRequest, respond_stream, respond_whole
from pdserve.api.responses_api import new_id as new_response_id
from pdserve.api.state import APIError, ServerState
from pdserve.engine.engine_client import EngineError
from pdserve.engine.messages import PDParams
from pdserve.http.auth import bearer_auth
from pdserve.http.disconnect import until_disconnect
from pdserve.http.errors import error_body
from pdserve.structured.spec import StructuredOutput, check, grammar_tokenizer
from pdserve.tokenization.detokenizer import IncrementalDetokenizer
from pdserve.tool_calling.grammar import tool_call_grammar
from pdserve.tool_calling.parsers import PARSERS
from pdserve.tool_calling.prompt import render_messages, template_supports_tools

log = logging.getLogger("pdserve.serve")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        tasks = [asyncio.create_task(_refresh_metrics(state)), asyncio.create_task(_exit_when_engine_dies(state))]
        if state.instance:
            tasks += [asyncio.create_task(register_forever(url, state.instance)) for url in state.router_urls]
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
        if first.get("type") == "refused_field":  # a field this server does not implement (protocol.REFUSED)
            field = (first.get("ctx") or {}).get("field")
            return JSONResponse(error_body(first["msg"], 400, param=field), status_code=400)
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        message = f"{'.'.join(loc) or 'body'}: {msg}"
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
        shape = AnswerShape(echo=body.echo, return_generated=body.max_tokens != 0,
                            prompt_logprobs_field=body.prompt_logprobs is not None, echo_text=_prompt_text(body))
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # the echoed prompt carries its logprobs
            prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
        structured = await _structured(state, body)
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens  # echo-only: one token computed, none shown
        params = _sampling_params(state, body, max_tokens, body.logprobs, structured,
                                  prompt_logprobs=prompt_logprobs)
        gen = Generation(f"cmpl-{uuid.uuid4().hex}", prompt_ids, pd=_pd_params(body), shape=shape)
        params = _migrate(state, body, gen, params)
        return await _respond(state, raw, body, gen, params, "text_completion", completion_choice)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        _check_model(state, body.model)
        prompt_ids = _chat_prompt(state, body)
        _check_length(state, prompt_ids)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        structured = await _structured(state, body)
        shape = AnswerShape(prompt_logprobs_field=body.prompt_logprobs is not None)
        if body.tools and body.tool_choice != "none":
            shape.tool_parser = PARSERS[state.tool_call_parser]
            shape.max_tool_calls = None if body.parallel_tool_calls else 1
            forced = await _forced_tool_grammar(state, body)
            if forced is not None:
                if structured is not None:
                    raise APIError("tool_choice required or a named function cannot be combined with "
                                   "response_format or structured_outputs", param="tool_choice")
                structured, shape.tools_forced = forced, True
        params = _sampling_params(state, body, max_tokens, logprobs, structured)
        gen = Generation(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, pd=_pd_params(body), shape=shape)
        params = _migrate(state, body, gen, params)
        return await _respond(state, raw, body, gen, params, "chat.completion", chat_choice)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Any:
        _check_model(state, body.model)
        if body.migration is not None:
            raise APIError("migration is served on /v1/completions and /v1/chat/completions", param="migration")
        messages = [ChatMessage(**m) for m in body.messages()]
        prompt_ids = _template_ids(state, messages, True, None, None)
        _check_length(state, prompt_ids)
        params = _sampling_params(state, body, body.max_output_tokens, None, await _structured(state, body))
        gen = Generation(new_response_id(), prompt_ids, pd=_pd_params(body))
        return await _respond(state, raw, body, gen, params, "response", None, responses_api=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        if body.messages is not None:
            ids = _template_ids(state, body.messages, body.add_generation_prompt, body.tools,
                                body.chat_template_kwargs)
        elif body.prompt is not None:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError("either prompt or messages is required", param="prompt")
        out: dict = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [state.tokenizer.token_text(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        if any(not 0 <= t < state.tokenizer.vocab_size for t in body.tokens):
            raise APIError(f"token ids must be in [0, {state.tokenizer.vocab_size})", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

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


def _prompt_text(body: CompletionRequest) -> str | None:
    prompt = body.prompt if body.prompt_token_ids is None else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _completion_prompt(state: ServerState, body: CompletionRequest) -> list[int]:
    prompt = body.prompt_token_ids if body.prompt_token_ids is not None else body.prompt
    if prompt is None:
        raise APIError("either prompt or prompt_token_ids is required", param="prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise APIError("one prompt per request is supported; send several requests", param="prompt")
        prompt = prompt[0]
    ids = state.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens) if isinstance(prompt, str) \
        else list(prompt)
    _check_length(state, ids)
    return ids


async def _respond(state: ServerState, raw: Request, body: Any, gen: Generation, params: Any, kind: str,
                   make_choice: Any, responses_api: bool = False) -> Any:
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
        release = StreamRelease(state, gen)
        # The generator's `finally` releases the slot; the background task covers a client that left
        # before the first chunk, when the generator never started and so never reaches `finally`.
        events = (respond_stream(state, body, gen, params, release) if responses_api
                  else stream(state, body, gen, params, kind, make_choice, release))
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(release))
    try:
        work = (respond_whole(state, body, gen, params) if responses_api
                else complete(state, body, gen, params, kind, make_choice))
        return await until_disconnect(raw, work)
    finally:
        state.in_flight -= 1


async def _structured(state: ServerState, body: Any) -> StructuredOutput | None:
    """The request's output constraint, checked against the model's tokenizer (off the event loop: a
    large schema takes a while): a spec that does not compile is the client's 400."""
    try:
        spec = body.structured_spec()
        if spec is not None:
            await _check_off_loop(state, spec)
    except ValueError as e:
        raise APIError(f"the output constraint cannot be used: {e}", param=body.constraint_field()) from None
    return spec


async def _check_off_loop(state: ServerState, spec: StructuredOutput) -> None:
    """A client's own grammar may name tokens (`<|im_end|>`, `<[1234]>`): only the vocabulary can check
    those, so it is checked with llguidance's tokenizer (0.3 s and ~70 MB of this process, once). JSON
    schemas, regexes, choices and the tool-call grammars cannot, and are checked without it."""
    tokenizer = state.tokenizer

    def run() -> None:
        vocab = (grammar_tokenizer(tokenizer.folder / "tokenizer.json", None, tokenizer.eos_token_ids)
                 if spec.kind == "grammar" else None)
        check(spec, vocab)

    await asyncio.to_thread(run)


async def _forced_tool_grammar(state: ServerState, body: ChatCompletionRequest) -> StructuredOutput | None:
    choice, tools = body.tool_choice, [t.model_dump(exclude_none=True) for t in body.tools or []]
    if choice == "required":
        spec = tool_call_grammar(tools, None, body.parallel_tool_calls)
    elif isinstance(choice, NamedToolChoice):
        spec = tool_call_grammar(tools, choice.name, False)
    else:
        return None
    try:
        await _check_off_loop(state, spec)
    except ValueError as e:
        raise APIError(f"the tools' parameter schemas cannot be used: {e}", param="tools") from None
    return spec


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tools = body.tools if body.tool_choice != "none" else None
    ids = _template_ids(state, body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs)
    tok = state.tokenizer
    if body.add_special_tokens and tok.add_bos_token and tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]  # vLLM's add_special_tokens on chat: the tokenizer's BOS before the template's
    return ids


def _template_ids(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                  tools: list[Tool] | None, kwargs: dict | None) -> list[int]:
    dumped = [m.model_dump(exclude_none=True) for m in messages]
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    rendered, extra = render_messages(dumped, tool_dicts, template_supports_tools(state.tokenizer.chat_template))
    try:
        return state.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                   tokenize=True, **extra, **(kwargs or {}))
    except Exception as e:  # the template raised on these messages
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None


def _migrate(state: ServerState, body: Any, gen: Generation, params: Any) -> Any:
    """The router's `migration` field: name token ids in the stream; resume after the ones given."""
    migration = body.migration
    if migration is None:
        return params
    if body.n != 1:
        raise APIError("migration serves one choice (n = 1)", param="migration")
    gen.report_tokens = True
    done = migration.token_ids
    if not done:
        return params
    if any(not 0 <= t < state.tokenizer.vocab_size for t in done):
        raise APIError("migration.token_ids must be in [0, vocab size)", param="migration")
    if params.max_tokens is not None and len(done) >= params.max_tokens:
        raise APIError(f"migration resumes after {len(done)} tokens, but max_tokens is {params.max_tokens}",
                       param="migration")
    gen.request_id = migration.id or gen.request_id
    gen.created = migration.created if migration.created is not None else gen.created
    gen.resume_after(done, IncrementalDetokenizer(state.tokenizer, params).add(done))
    return msgspec.structs.replace(params, prompt_logprobs=None)  # they went out with the first chunk


def _pd_params(body: Any) -> PDParams | None:
    pd = body.pd
    return None if pd is None else PDParams(pd.transfer_id, pd.role, pd.prefill_addr, pd.transport)


def _sampling_params(state: ServerState, body: Any, max_tokens: int | None, logprobs: int | None,
                     structured: StructuredOutput | None, **overrides: Any) -> Any:
    try:
        params = body.sampling_params(max_tokens, logprobs, state.sampling_defaults, structured)
        params = msgspec.structs.replace(params, **overrides) if overrides else params
        params.check_vocab(state.tokenizer.vocab_size)
        return params
    except ValueError as e:  # a combination the field checks cannot see (min_tokens > max_tokens, ...)
        raise APIError(str(e)) from None


