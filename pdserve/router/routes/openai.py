"""The OpenAI API as clients see it: generation requests forwarded to the route the selector picks (a
prefill/decode pair or a mixed instance); models, tokenize and detokenize to any instance."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.admission.predictor import Refusal
from pdserve.http.disconnect import until_disconnect
from pdserve.http.errors import REQUEST_ID_HEADER, error_body, explain_error
from pdserve.router.admission import Admitted
from pdserve.router.outcome import error_response, response_message
from pdserve.router.state import RouterDep, RouterState

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from pdserve.router.tracing import RequestTrace

router = APIRouter()
log = logging.getLogger("pdserve.router")


@router.post("/v1/completions")
async def completions(raw: Request, state: RouterDep) -> Response:
    return await _forward(raw, state, "/v1/completions")


@router.post("/v1/chat/completions")
async def chat(raw: Request, state: RouterDep) -> Response:
    return await _forward(raw, state, "/v1/chat/completions")


@router.post("/v1/responses")
async def responses(raw: Request, state: RouterDep) -> Response:
    return await _forward(raw, state, "/v1/responses")


@router.get("/v1/models")
async def models(raw: Request, state: RouterDep) -> Response:
    return await _to_any_instance(raw, state, "/v1/models")


@router.post("/tokenize")
async def tokenize(raw: Request, state: RouterDep) -> Response:
    return await _to_any_instance(raw, state, "/tokenize")


@router.post("/detokenize")
async def detokenize(raw: Request, state: RouterDep) -> Response:
    return await _to_any_instance(raw, state, "/detokenize")


async def _forward(raw: Request, state: RouterState, path: str) -> Response:
    request_id = raw.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    traced = Traced()
    try:
        response = await _forward_checked(raw, state, path, request_id, traced)
    except BaseException:
        if traced.trace is not None:
            traced.trace.end(499, "the client left")
        raise
    if (trace := traced.trace) is not None:
        if isinstance(response, StreamingResponse):
            response.body_iterator = trace.until_streamed(response.body_iterator)
        else:
            trace.end(response.status_code, response_message(response)[:300] if response.status_code >= 400 else None)
    state.metrics.requests.labels(str(response.status_code)).inc()
    state.recent.add(response.status_code)
    if response.status_code >= 400:
        explain_error(log, state.metrics.failed, raw.method, path, request_id, response.status_code,
                      getattr(response, "body", b""))
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


class Traced:
    """The request's trace, once its body is read (None: tracing is off or its trace is not sampled)."""

    trace: RequestTrace | None = None


async def _forward_checked(raw: Request, state: RouterState, path: str, request_id: str, traced: Traced) -> Response:
    received = time.monotonic()
    limit = state.settings.max_request_bytes
    body = await _read_limited(raw, limit)
    if body is None:
        state.metrics.refused.labels("too_large").inc()
        return error_response(f"the request body is larger than {limit} bytes (--max-request-bytes)", 413,
                              "invalid_request_error")
    try:
        parsed = json.loads(body)
        if not isinstance(parsed, dict):
            raise ValueError("the body must be a JSON object")
    except ValueError as e:
        return error_response(f"the request body is not valid JSON: {e}", 400, "invalid_request_error")
    if state.tracing is not None:
        traced.trace = state.tracing.start(raw.headers, path, parsed, request_id, state.settings.host,
                                           state.settings.port)
    trace = traced.trace
    request = state.reader.read(path, parsed)
    model = parsed.get("model")
    if isinstance(model, str) and state.selector.serves_lora(model):
        request.lora = model  # only the instances serving the adapter may take it; its KV hashes apart
    priority = parsed.get("priority", 0)
    request.priority = priority if isinstance(priority, int) else 0  # a bad one: the instance's 400 names it
    avoid: set[str] = set()
    admitted = None
    if state.admission is not None:
        verdict = state.admission.admit(raw.headers, parsed, request, received)
        if isinstance(verdict, Refusal):
            if trace is not None:
                trace.refused(verdict.message)
            return JSONResponse(error_body(verdict.message, 429, verdict.error_type), status_code=429,
                                headers={"Retry-After": verdict.retry_after_header})
        admitted, avoid = verdict, verdict.excluded
        if trace is not None:
            trace.admitted(avoid)
    started = time.monotonic()
    headers = {**_passed_headers(raw.headers), REQUEST_ID_HEADER: request_id}
    work = state.forwarder.forward(path, parsed, request, headers, avoid, trace)
    # A streamed answer stops when the client does (its generator is closed); a whole one would not.
    response = await (work if parsed.get("stream") else until_disconnect(raw, work))
    if admitted is not None:
        _admission_finished(state, admitted, response, parsed.get("stream"), time.monotonic() - started)
    return response


def _admission_finished(state: RouterState, admitted: Admitted, response: Response, stream: bool,
                        seconds: float) -> None:
    """A stream's response comes with its first event (TTFT, against the prediction of the instance that
    computed the prompt); a whole answer's usage says the generated tokens its key is charged for."""
    if response.status_code != 200:
        return
    if stream:
        state.admission.first_token(admitted, seconds)
        return
    if state.admission.limits is None:  # nothing to charge: no need to read the answer
        return
    try:
        usage = json.loads(response.body).get("usage") or {}
    except (ValueError, AttributeError):
        return
    state.admission.finished(admitted, int(usage.get("completion_tokens") or 0))


async def _to_any_instance(raw: Request, state: RouterState, path: str) -> Response:
    """A request any instance answers alike (they serve one model): the first healthy one."""
    live = state.registry.healthy()
    if not live:
        return error_response("no instance is registered and healthy", 503)
    body = await _read_limited(raw, state.settings.max_request_bytes) if raw.method == "POST" else None
    if raw.method == "POST" and body is None:
        return error_response("the request body is too large", 413, "invalid_request_error")
    headers = {**_passed_headers(raw.headers), "content-type": "application/json"}
    try:
        async with state.forwarder.client.request(raw.method, f"{live[0].url}{path}", data=body,
                                                  headers=headers) as r:
            return Response(await r.read(), status_code=r.status, media_type="application/json")
    except (TimeoutError, aiohttp.ClientError) as e:
        return error_response(f"instance {live[0].url} did not answer: {e}", 502)


def _passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """What the router passes to instances: the client's credentials (instances may check the same key)."""
    auth = headers.get("authorization")
    return {"authorization": auth} if auth else {}


async def _read_limited(raw: Request, limit: int) -> bytes | None:
    """The body, or None if it is over `limit` bytes (checked before reading when the length is declared)."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in raw.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
