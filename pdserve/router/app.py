"""The router's HTTP face: registration, health, and OpenAI requests forwarded to a P/D pair.

A PD request goes to both instances at once, each told the shared transfer id and (D) where P's
control plane is. D's answer is what the client gets, streamed through as it comes. If P fails
before D has produced anything, the client gets P's error and D's request is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pdserve.api.protocol import error_body
from pdserve.router.registry import Registration, Registry

log = logging.getLogger("pdserve.router")


class Unregistration(BaseModel):
    url: str


def _error(message: str, status: int, err_type: str = "service_unavailable") -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


def build_router_app(registry: Registry, request_timeout: float = 600.0) -> FastAPI:
    client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal client
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=5.0), limits=limits)
        yield
        await client.aclose()

    app = FastAPI(title="pdserve router", lifespan=lifespan)

    @app.post("/register")
    async def register(info: Registration) -> dict:
        if registry.register(info):
            log.info("registered %s instance %s", info.role, info.url)
        return {"status": "ok"}

    @app.post("/unregister")
    async def unregister(body: Unregistration) -> dict:
        registry.unregister(body.url)
        log.info("unregistered %s", body.url)
        return {"status": "ok"}

    @app.get("/instances")
    async def instances() -> dict:
        return {"instances": [i.model_dump() for i in registry.live()]}

    @app.get("/health")
    async def health() -> Response:
        if registry.ready():
            return Response(status_code=200)
        return _error("no complete prefill/decode pair (or mixed instance) is registered", 503)

    @app.get("/v1/models")
    async def models() -> Response:
        live = registry.live()
        if not live:
            return _error("no instance is registered", 503)
        try:
            r = await client.get(f"{live[0].url}/v1/models")
        except httpx.HTTPError as e:
            return _error(f"instance {live[0].url} did not answer: {e}", 502)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await _forward(raw, "/v1/chat/completions")

    async def _forward(raw: Request, path: str) -> Response:
        try:
            body = json.loads(await raw.body())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return _error(f"the request body is not valid JSON: {e}", 400, "invalid_request_error")
        pair = registry.pick()
        if pair is None:
            return _error("no complete prefill/decode pair (or mixed instance) is registered", 503)
        first, decode = pair
        if decode is None:
            return await _proxy(client, f"{first.url}{path}", body)
        return await _forward_pd(client, first, decode, path, body)

    return app


async def _proxy(client: httpx.AsyncClient, url: str, body: dict) -> Response:
    """Send `body` to one instance and pass its answer (streamed or not) through."""
    try:
        upstream = await client.send(client.build_request("POST", url, json=body), stream=True)
    except httpx.HTTPError as e:
        return _error(f"instance {url} is unreachable: {e}", 502)
    return await _pass_through(upstream, upstream.aiter_raw(), body.get("stream", False))


async def _pass_through(upstream: httpx.Response, body: AsyncIterator[bytes], stream: bool) -> Response:
    """Relay `upstream`, reading its body from `body` (its own iterator, or the router's queue of it)."""
    if not stream or upstream.status_code != 200:
        try:
            content = b"".join([chunk async for chunk in body])
        except httpx.HTTPError as e:
            return _error(f"PD error: the instance {upstream.request.url} failed mid-answer: {e}", 502)
        finally:
            await upstream.aclose()
        return Response(content, status_code=upstream.status_code, media_type="application/json")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        except httpx.HTTPError as e:
            yield f"data: {json.dumps(error_body(f'PD error: the decode instance failed mid-answer: {e}', 502))}\n\n"\
                .encode()
        finally:
            await upstream.aclose()

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _forward_pd(client: httpx.AsyncClient, prefill: Registration, decode: Registration, path: str,
                      body: dict) -> Response:
    """Send the request to P and D at once; relay D's answer.

    P answers its own request right after its first token, before D can have a token of its own, so
    D's bytes are held until P has answered: if P failed (overloaded, bad request, gone), the client
    gets P's error at once and D's request is cancelled, instead of waiting out D's lease.
    """
    transfer_id = uuid.uuid4().hex
    p_body = {**body, "stream": False, "pd": {"transfer_id": transfer_id, "role": "prefill"}}
    d_body = {**body, "pd": {"transfer_id": transfer_id, "role": "decode", "prefill_addr": prefill.pd_comm}}
    p_task = asyncio.create_task(client.post(f"{prefill.url}{path}", json=p_body))
    d_task = asyncio.create_task(
        client.send(client.build_request("POST", f"{decode.url}{path}", json=d_body), stream=True))
    done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
    if p_task in done and (p_error := _prefill_error(p_task, prefill.url)) is not None:
        await _cancel_response(d_task)
        return p_error
    try:
        upstream = await d_task
    except httpx.HTTPError as e:
        p_task.cancel()
        return _error(f"PD error: the decode instance {decode.url} is unreachable: {e}", 502)
    if upstream.status_code != 200:  # D refused it (bad request, overloaded): P must not wait for it
        p_task.cancel()
        return await _pass_through(upstream, upstream.aiter_raw(), False)
    queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
    reader = asyncio.create_task(_pump(upstream.aiter_raw(), queue))
    if not p_task.done():
        await asyncio.wait({p_task, reader}, return_when=asyncio.FIRST_COMPLETED)
    if p_task.done() and (p_error := _prefill_error(p_task, prefill.url)) is not None:
        reader.cancel()
        await upstream.aclose()
        return p_error
    p_task.add_done_callback(_log_prefill_outcome(prefill.url))
    return await _pass_through(upstream, _drain(queue, reader), body.get("stream", False))


async def _pump(body: AsyncIterator[bytes], queue: asyncio.Queue) -> None:
    try:
        async for chunk in body:
            await queue.put(chunk)
    except httpx.HTTPError as e:
        await queue.put(e)
    finally:
        await queue.put(None)


async def _drain(queue: asyncio.Queue, reader: asyncio.Task) -> AsyncIterator[bytes]:
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        reader.cancel()


async def _cancel_response(task: asyncio.Task) -> None:
    """Cancel a pending `client.send`, or close the response it already produced."""
    task.cancel()
    try:
        response = await task
    except (asyncio.CancelledError, httpx.HTTPError):
        return
    await response.aclose()


def _prefill_error(task: asyncio.Task, url: str) -> Response | None:
    """P's failure as the client's answer, or None if P succeeded (or is still working)."""
    try:
        r = task.result()
    except httpx.HTTPError as e:
        return _error(f"PD error: the prefill instance {url} is unreachable: {e}", 502)
    if r.status_code == 200:
        return None
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:500]
    if r.status_code >= 500 and not message.startswith("PD error"):
        message = f"PD error: the prefill instance {url} failed: {message}"
    return JSONResponse(error_body(message, r.status_code), status_code=r.status_code)


def _log_prefill_outcome(url: str):  # noqa: ANN202
    def done(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("prefill instance %s: %s", url, task.exception())
        elif task.result().status_code != 200:
            log.warning("prefill instance %s answered %d: %s", url, task.result().status_code,
                        task.result().text[:300])
    return done
