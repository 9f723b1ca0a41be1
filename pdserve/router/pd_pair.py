"""One try of a PD route: the request goes to P and D at once, each told the shared transfer id; D also gets P's
control address and the transport the router chose. D's answer is what the client gets. P answers its own request
right after its first token, before D can have a token of its own, so D's bytes are held until P has answered: if P
failed, D's request is cancelled and nothing has reached the client. When D fails, P is blamed if it fails too
within BLAME_WINDOW (D may only be reporting P's failure)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from fastapi.responses import JSONResponse, Response

from pdserve.balancing.policies import RoutedRequest
from pdserve.http.errors import PD_ERROR, error_body, read_error
from pdserve.http.wire import PDRequest
from pdserve.kv_events.index import KVIndex
from pdserve.router.exchange import BROKEN, Exchange, cancel_response, close_late_response, pump
from pdserve.router.kv_pull import pull_hint
from pdserve.router.outcome import Leg, Outcome, Retry, error_response
from pdserve.router.registry import Registry
from pdserve.router.relay import RETRYABLE_STATUS, read_error_answer, relay
from pdserve.router.selector import Route

log = logging.getLogger("pdserve.router")

BLAME_WINDOW = 1.0  # seconds to wait for P's answer when D fails, to tell which of the two failed


@dataclass
class Answer:
    """A whole (non-streamed) answer: P's."""

    status: int
    body: bytes

    def error(self) -> tuple[str, str]:
        """Its error's message and type."""
        error = read_error(self.body) or {}
        return (str(error.get("message") or self.body[:500].decode(errors="replace")),
                str(error.get("type") or "internal_server_error"))


class PairForwarder:
    def __init__(self, client: aiohttp.ClientSession, registry: Registry, kv_index: KVIndex | None,
                 count_cached: Callable[[Route, bytes], None]) -> None:
        self.client, self.registry, self.kv_index = client, registry, kv_index
        self.count_cached = count_cached  # P's answer: what it found cached

    async def forward(self, route: Route, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                      to_compute: int) -> Outcome:
        prefill, decode = route.first, route.decode
        assert decode is not None
        p_body, d_body = self._bodies(route, body, request)
        p_ex = Exchange(self.registry, prefill, request.num_tokens, to_compute)
        d_ex = Exchange(self.registry, decode, request.num_tokens)
        p_task = asyncio.create_task(p_ex.guard(_fetch(self.client, f"{prefill.url}{path}", p_body, headers)))
        p_task.add_done_callback(lambda _: p_ex.close())
        d_task = asyncio.create_task(d_ex.guard(self.client.post(f"{decode.url}{path}", json=d_body,
                                                                 headers=headers)))
        handed_over = False  # to the relay, which then owns D's exchange
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task.done() and (failure := _prefill_failure(p_ex, p_task)) is not None:
                return failure
            held = await self._decode_answer(route, d_ex, d_task, p_ex, p_task)
            if not isinstance(held, Leg):
                return held
            handed_over = True  # before the relay: it owns D's exchange even if it is cancelled
            return await relay(d_ex, held.upstream, body.get("stream", False), held.queue, held.reader)
        finally:
            if not handed_over:
                p_task.cancel()
                p_task.add_done_callback(close_late_response)
                d_ex.close()
                await cancel_response(d_task)

    def _bodies(self, route: Route, body: dict, request: RoutedRequest) -> tuple[dict, dict]:
        prefill = route.first
        transfer_id = uuid.uuid4().hex
        p_body = {**body, "stream": False,
                  "pd": PDRequest(transfer_id=transfer_id, role="prefill").model_dump(exclude_none=True)}
        if (hint := pull_hint(self.kv_index, self.registry, prefill, request)) is not None:
            p_body["kv_pull"] = hint
        d_body = {**body, "pd": PDRequest(transfer_id=transfer_id, role="decode", prefill_addr=prefill.info.pd_comm,
                                          transport=route.transport).model_dump(exclude_none=True)}
        return p_body, d_body

    async def _decode_answer(self, route: Route, d_ex: Exchange, d_task: asyncio.Task, p_ex: Exchange,
                             p_task: asyncio.Task) -> Outcome | Leg:
        """D's answer held until P has answered: its leg, to relay, when both succeeded; else the outcome."""
        decode = d_ex.instance
        try:
            upstream = await d_task
        except BROKEN as e:
            d_ex.broken(e)
            return await _blame(p_ex, p_task, Retry(decode, error_response(
                f"PD error: the decode instance {decode.url} is unreachable: {e}", 502, PD_ERROR)))
        if upstream.status != 200:  # D refused it (bad request, overloaded)
            answer = await read_error_answer(upstream, d_ex)
            if upstream.status in RETRYABLE_STATUS:
                return await _blame(p_ex, p_task, Retry(decode, answer))
            return answer
        queue: asyncio.Queue = asyncio.Queue()
        leg = Leg(d_ex, upstream, asyncio.create_task(pump(d_ex.chunks(upstream), queue)), queue)
        if not p_task.done():
            await asyncio.wait({p_task, leg.reader}, return_when=asyncio.FIRST_COMPLETED)
        if not p_task.done() and (error := leg.reader.result()) is not None:  # D broke before P answered
            d_ex.broken(error)
            leg.upstream.close()
            return await _blame(p_ex, p_task, Retry(decode, error_response(
                f"PD error: the decode instance {decode.url} failed: {error}", 502, PD_ERROR)))
        if not p_task.done():  # D already finished (a one-token answer): P's answer is on its way
            await asyncio.wait({p_task})
        if (failure := _prefill_failure(p_ex, p_task)) is not None:
            leg.reader.cancel()
            leg.upstream.close()
            return failure
        self.count_cached(route, p_task.result().body)
        return leg


async def _blame(p_ex: Exchange, p_task: asyncio.Task, d_failure: Retry) -> Retry:
    """D failed; if P fails too (D may only be reporting P's failure), P is the one to avoid."""
    if not p_task.done():
        await asyncio.wait({p_task}, timeout=BLAME_WINDOW)
    if p_task.done() and (p_failure := _prefill_failure(p_ex, p_task)) is not None:
        return p_failure if isinstance(p_failure, Retry) else Retry(p_ex.instance, p_failure)
    return d_failure


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
    message, err_type = r.error()
    if r.status >= 500 and err_type != PD_ERROR:
        message, err_type = f"PD error: the prefill instance {url} failed: {message}", PD_ERROR
    answer = JSONResponse(error_body(message, r.status, err_type), status_code=r.status)
    if r.status in RETRYABLE_STATUS:
        log.warning("prefill instance %s answered %d: %s", url, r.status, message[:300])
        return Retry(p_ex.instance, answer)
    return answer
