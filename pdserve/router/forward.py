"""Forwarding one OpenAI request to its route, with failover.

A PD request goes to P and D at once, each told the shared transfer id; D also gets P's control
address and the transport the router chose. D's answer is what the client gets. P answers its own
request right after its first token, before D can have a token of its own, so D's bytes are held
until P has answered: if P failed, D's request is cancelled and nothing has reached the client.

Until the first byte goes to the client (for a non-streamed answer: until the whole answer is in),
a failed instance (unreachable, lost from the pool, 5xx, 429) is excluded and the request is tried
again on another route, at most `max_retries` times. After that, a streamed answer that breaks ends
with an error event. Every exchange is tied to its instance: when the registry loses the instance
(failed probes, a connection error seen by another request, expiry), the exchange ends at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.http.errors import PD_ERROR, error_body
from pdserve.http.wire import PDRequest
from pdserve.router.exchange import BROKEN, Exchange, cancel_response, close_late_response, drain, next_chunk, pump
from pdserve.router.policies import RoutedRequest
from pdserve.router.registry import Instance, Registry
from pdserve.router.selector import Route, Selector

log = logging.getLogger("pdserve.router")

RETRYABLE_STATUS = (429, 500, 502, 503, 504)
BLAME_WINDOW = 1.0  # seconds to wait for P's answer when D fails, to tell which of the two failed


def error_response(message: str, status: int, err_type: str = "service_unavailable") -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


@dataclass
class Retry:
    """This route failed before the client saw anything; try another without `failed`."""

    failed: Instance
    response: Response


class Forwarder:
    def __init__(self, client: aiohttp.ClientSession, registry: Registry, selector: Selector, max_retries: int = 2,
                 on_retry: Callable[[], None] = lambda: None) -> None:
        self.client, self.registry, self.selector = client, registry, selector
        self.max_retries = max_retries
        self.on_retry = on_retry

    async def forward(self, path: str, body: dict, request: RoutedRequest, headers: dict[str, str]) -> Response:
        excluded: set[str] = set()
        last: Response | None = None
        for attempt in range(self.max_retries + 1):
            route = self.selector.pick(request, excluded)
            if route is None:
                break
            if route.decode is None:
                outcome = await self._single(route.first, path, body, request, headers)
            else:
                outcome = await self._pd(route, path, body, request, headers)
            if not isinstance(outcome, Retry):
                return outcome
            excluded.add(outcome.failed.url)
            last = outcome.response
            if attempt < self.max_retries:
                log.warning("retrying a request without %s (%d of %d)", outcome.failed.url, attempt + 1,
                            self.max_retries)
                self.on_retry()
        if last is not None:
            return last
        return error_response(self.selector.why_not(), 503)

    # ---- one mixed instance ----------------------------------------------------------------------

    async def _single(self, instance: Instance, path: str, body: dict, request: RoutedRequest,
                      headers: dict[str, str]) -> Response | Retry:
        ex = Exchange(self.registry, instance, request.num_tokens)
        try:
            upstream = await ex.guard(self.client.post(f"{instance.url}{path}", json=body, headers=headers))
        except BROKEN as e:
            ex.broken(e)
            ex.close()
            return Retry(instance, error_response(f"instance {instance.url} is unreachable: {e}", 502))
        except BaseException:  # cancelled: the client hung up
            ex.close()
            raise
        return await self._relay(ex, upstream, body.get("stream", False))

    # ---- a prefill/decode pair -------------------------------------------------------------------

    async def _pd(self, route: Route, path: str, body: dict, request: RoutedRequest,
                  headers: dict[str, str]) -> Response | Retry:
        prefill, decode = route.first, route.decode
        assert decode is not None
        transfer_id = uuid.uuid4().hex
        p_body = {**body, "stream": False,
                  "pd": PDRequest(transfer_id=transfer_id, role="prefill").model_dump(exclude_none=True)}
        d_body = {**body, "pd": PDRequest(transfer_id=transfer_id, role="decode", prefill_addr=prefill.info.pd_comm,
                                          transport=route.transport).model_dump(exclude_none=True)}
        p_ex = Exchange(self.registry, prefill, request.num_tokens)
        d_ex = Exchange(self.registry, decode, request.num_tokens)
        p_task = asyncio.create_task(p_ex.guard(_fetch(self.client, f"{prefill.url}{path}", p_body, headers)))
        p_task.add_done_callback(lambda _: p_ex.close())
        d_task = asyncio.create_task(d_ex.guard(self.client.post(f"{decode.url}{path}", json=d_body,
                                                                 headers=headers)))
        handed_over = False
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task.done() and (failure := _prefill_failure(p_ex, p_task)) is not None:
                return failure
            try:
                upstream = await d_task
            except BROKEN as e:
                d_ex.broken(e)
                return await self._blame(p_ex, p_task, Retry(
                    decode, error_response(f"PD error: the decode instance {decode.url} is unreachable: {e}", 502,
                                           PD_ERROR)))
            if upstream.status != 200:  # D refused it (bad request, overloaded)
                answer = await self._read_error(upstream, d_ex)
                if upstream.status in RETRYABLE_STATUS:
                    return await self._blame(p_ex, p_task, Retry(decode, answer))
                return answer
            queue: asyncio.Queue = asyncio.Queue()
            reader = asyncio.create_task(pump(d_ex.chunks(upstream), queue))
            if not p_task.done():
                await asyncio.wait({p_task, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not p_task.done() and (error := reader.result()) is not None:  # D broke before P answered
                d_ex.broken(error)
                upstream.close()
                return await self._blame(p_ex, p_task, Retry(
                    decode, error_response(f"PD error: the decode instance {decode.url} failed: {error}", 502,
                                           PD_ERROR)))
            if not p_task.done():  # D already finished (a one-token answer): P's answer is on its way
                await asyncio.wait({p_task})
            if (failure := _prefill_failure(p_ex, p_task)) is not None:
                reader.cancel()
                upstream.close()
                return failure
            handed_over = True
            return await self._relay(d_ex, upstream, body.get("stream", False), queue, reader)
        finally:
            if not handed_over:
                p_task.cancel()
                p_task.add_done_callback(close_late_response)
                d_ex.close()
                await cancel_response(d_task)

    async def _blame(self, p_ex: Exchange, p_task: asyncio.Task, d_failure: Retry) -> Retry:
        """D failed; if P fails too (D may only be reporting P's failure), P is the one to avoid."""
        if not p_task.done():
            await asyncio.wait({p_task}, timeout=BLAME_WINDOW)
        if p_task.done() and (p_failure := _prefill_failure(p_ex, p_task)) is not None:
            return p_failure if isinstance(p_failure, Retry) else Retry(p_ex.instance, p_failure)
        return d_failure

    # ---- relaying the answer ---------------------------------------------------------------------

    async def _relay(self, ex: Exchange, upstream: aiohttp.ClientResponse, stream: bool,
                     queue: asyncio.Queue | None = None, reader: asyncio.Task | None = None) -> Response | Retry:
        """Pass `upstream` through (its body from `queue` when a pump already reads it). Owns `ex` from here."""
        if upstream.status != 200:
            try:
                answer = await self._read_error(upstream, ex)
            finally:
                ex.close()
            return Retry(ex.instance, answer) if upstream.status in RETRYABLE_STATUS else answer
        if queue is None:
            queue = asyncio.Queue()
            reader = asyncio.create_task(pump(ex.chunks(upstream), queue))
        if not stream:
            try:  # the finally below also runs when the client hangs up (cancellation)
                content = b"".join([chunk async for chunk in drain(queue)])
            except BROKEN as e:
                ex.broken(e)
                return Retry(ex.instance, error_response(
                    f"PD error: the instance {ex.instance.url} failed mid-answer: {e}", 502, PD_ERROR))
            finally:
                reader.cancel()
                upstream.close()
                ex.close()
            return Response(content, status_code=200, media_type="application/json")
        try:  # the first bytes decide: a failure before them can still be retried elsewhere
            first = await next_chunk(queue)
        except BaseException as e:
            reader.cancel()
            upstream.close()
            ex.close()
            if not isinstance(e, BROKEN):
                raise
            ex.broken(e)
            return Retry(ex.instance, error_response(f"PD error: the instance {ex.instance.url} failed: {e}", 502,
                                                     PD_ERROR))

        async def events() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield first
                    async for chunk in drain(queue):
                        yield chunk
            except BROKEN as e:
                ex.broken(e)
                message = f"PD error: the {ex.instance.role} instance {ex.instance.url} failed mid-answer: {e}"
                yield f"data: {json.dumps(error_body(message, 502, PD_ERROR))}\n\n".encode()
            finally:
                reader.cancel()
                upstream.close()
                ex.close()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _read_error(self, upstream: aiohttp.ClientResponse, ex: Exchange) -> Response:
        try:
            content = await ex.guard(upstream.read())
        except BROKEN as e:
            content = json.dumps(error_body(f"the instance failed while answering: {e}", 502)).encode()
        finally:
            upstream.close()
        return Response(content, status_code=upstream.status, media_type="application/json")


@dataclass
class Answer:
    """A whole (non-streamed) answer."""

    status: int
    body: bytes

    def error_message(self) -> str:
        try:
            return json.loads(self.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return self.body[:500].decode(errors="replace")

    def error_type(self) -> str:
        try:
            return str(json.loads(self.body)["error"]["type"])
        except (ValueError, KeyError, TypeError):
            return "internal_server_error"


async def _fetch(client: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]) -> Answer:
    async with client.post(url, json=body, headers=headers) as r:
        return Answer(r.status, await r.read())


def _prefill_failure(p_ex: Exchange, task: asyncio.Task) -> Response | Retry | None:
    """P's failure (a Retry when another P may do better), or None if P succeeded."""
    url = p_ex.instance.url
    try:
        r: Answer = task.result()
    except BROKEN as e:
        p_ex.broken(e)
        return Retry(p_ex.instance, error_response(f"PD error: the prefill instance {url} is unreachable: {e}", 502,
                                                   PD_ERROR))
    if r.status == 200:
        return None
    message, err_type = r.error_message(), r.error_type()
    if r.status >= 500 and err_type != PD_ERROR:
        message, err_type = f"PD error: the prefill instance {url} failed: {message}", PD_ERROR
    answer = JSONResponse(error_body(message, r.status, err_type), status_code=r.status)
    if r.status in RETRYABLE_STATUS:
        log.warning("prefill instance %s answered %d: %s", url, r.status, message[:300])
        return Retry(p_ex.instance, answer)
    return answer
