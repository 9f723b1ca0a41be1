"""Forwarding one OpenAI request to its route, with failover.

A PD request goes to P and D at once, each told the shared transfer id; D also gets P's control
address and the transport the router chose. D's answer is what the client gets. P answers its own
request right after its first token, before D can have a token of its own, so D's bytes are held
until P has answered: if P failed, D's request is cancelled and nothing has reached the client.

Until the first event goes to the client (for a non-streamed answer: until the whole answer is in),
a failed instance (unreachable, lost from the pool, 5xx, 429, a 5xx error event) is excluded and the
request is tried again on another route, at most `max_retries` times. After that, a streamed answer
that breaks is resumed on another route where it stopped (migration.py), at most `migration_limit`
times, and then ends with an error event. Streams are relayed event by event (sse.py). Every exchange
is tied to its instance: when the registry loses the instance (failed probes, a connection error seen
by another request, expiry), the exchange ends at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.balancing.policies import RoutedRequest
from pdserve.http.errors import PD_ERROR, error_body
from pdserve.http.wire import SENT_HEADER, PDRequest
from pdserve.kv_events.index import KVIndex
from pdserve.router.exchange import BROKEN, Exchange, cancel_response, close_late_response, drain, pump
from pdserve.router.kv_pull import pull_hint
from pdserve.router.migration import AnswerSoFar, can_migrate
from pdserve.router.registry import Instance, Registry
from pdserve.router.selector import Route, Selector
from pdserve.router.sse import DONE, error_event, server_error, take_token_ids, whole_events

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from pdserve.router.tracing import RequestTrace

log = logging.getLogger("pdserve.router")

RETRYABLE_STATUS = (429, 500, 502, 503, 504)
BLAME_WINDOW = 1.0  # seconds to wait for P's answer when D fails, to tell which of the two failed
MIGRATION_WAIT_S = 30.0  # how long a broken stream waits for a route to resume on
ROUTE_WAIT_S = 30.0  # how long a new request waits for a route when the pool lost its last one
OUTAGE_MEMORY_S = 120.0  # ... if the pool had one this recently (else it answers 503 at once)


def error_response(message: str, status: int, err_type: str = "service_unavailable") -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


@dataclass
class Retry:
    """This route failed before the client saw anything; try another without `failed` (None: the
    instance answered, with an error event of its own, and stays a candidate)."""

    failed: Instance | None
    response: Response


@dataclass
class Opened:
    """A streamed answer whose first event is in hand; `close` ends the exchange."""

    ex: Exchange
    upstream: aiohttp.ClientResponse
    reader: asyncio.Task
    first: bytes
    rest: AsyncIterator[bytes]
    leg: Any = None  # router/tracing.RouteSpan of its route, when traced: ends with the exchange

    async def events(self) -> AsyncIterator[bytes]:
        yield self.first
        async for event in self.rest:
            yield event

    def close(self, error: str | None = None) -> None:
        self.reader.cancel()
        self.upstream.close()
        self.ex.close()
        if self.leg is None:
            return
        if error:
            self.leg.failed(error)
        else:
            self.leg.answered(200)
        self.leg = None


class Forwarder:
    def __init__(self, client: aiohttp.ClientSession, registry: Registry, selector: Selector, max_retries: int = 2,
                 on_retry: Callable[[], None] = lambda: None, migration_limit: int = 3,
                 on_migration: Callable[[bool, float], None] = lambda resumed, seconds: None,
                 on_cached: Callable[[int, int], None] = lambda predicted, reported: None,
                 on_route: Callable[[Route, RoutedRequest], None] = lambda route, request: None,
                 kv_index: KVIndex | None = None) -> None:
        self.client, self.registry, self.selector = client, registry, selector
        self.kv_index = kv_index  # KV events' exact index: where a prefix could be pulled from (router/kv_pull.py)
        self.max_retries = max_retries
        self.on_retry = on_retry
        self.migration_limit, self.on_migration = migration_limit, on_migration
        self.on_cached = on_cached  # cache_aware's predicted cached prompt tokens, and what the engine reported
        self.on_route = on_route  # each route taken (admission counts what it sent where)
        self.routed_at: float | None = None  # when a request last found a route

    async def forward(self, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                      avoid: set[str] | None = None, trace: RequestTrace | None = None) -> Response:
        """`avoid`: instances the first try does not route to (admission's: they would miss an SLO); once the
        request was admitted and a route failed it, any working instance is better than none."""
        answer = AnswerSoFar(self.migration_limit if can_migrate(path, body, self.migration_limit) else 0)
        if answer.limit:
            body = {**body, "migration": {}}  # instances name each event's tokens
        outcome = await self._open(path, body, request, headers, set(), avoid or set(), trace)
        if isinstance(outcome, Opened):
            return StreamingResponse(self._relay_stream(outcome, answer, path, body, request, headers, trace),
                                     media_type="text/event-stream")
        return outcome

    async def _open(self, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                    excluded: set[str], avoid: frozenset[str] | set[str] = frozenset(),
                    trace: RequestTrace | None = None) -> Response | Opened:
        """The request on the first route that works, trying others while nothing reached the client."""
        last: Response | None = None
        for attempt in range(self.max_retries + 1):
            route = self.selector.pick(request, excluded | avoid if attempt == 0 else excluded)
            if route is None and attempt == 0 and self._lost_its_routes():
                route = await self._route_when_back(request, excluded)
            if route is None:
                break
            self.routed_at = time.monotonic()
            self.on_route(route, request)
            hop = {**headers, SENT_HEADER: request.sent_tag} if request.sent_tag else headers
            leg = trace.route(route, request, attempt) if trace is not None else None
            if leg is not None:
                hop = {**hop, **leg.headers}
            try:
                if route.decode is None:
                    outcome = await self._single(route, path, body, request, hop)
                    if isinstance(outcome, Response) and not isinstance(outcome, StreamingResponse):
                        self._count_cached(route, outcome.body)
                else:
                    outcome = await self._pd(route, path, body, request, hop)
            except BaseException:  # the client hung up
                if leg is not None:
                    leg.failed("the client left")
                raise
            if leg is not None:
                settle(leg, outcome)
            if not isinstance(outcome, Retry):
                return outcome
            if outcome.failed is not None:
                excluded.add(outcome.failed.url)
            last = outcome.response
            if attempt < self.max_retries:
                log.warning("retrying a request without %s (%d of %d)",
                            outcome.failed.url if outcome.failed else "change", attempt + 1, self.max_retries)
                self.on_retry()
                if trace is not None:
                    trace.retried(outcome.failed.url if outcome.failed else None, attempt + 1)
        if last is not None:
            return last
        return error_response(self.selector.why_not(), 503)

    def _lost_its_routes(self) -> bool:
        """The pool served a moment ago: its last route is being restarted (launch) or placed again (Ray)."""
        return self.routed_at is not None and time.monotonic() - self.routed_at < OUTAGE_MEMORY_S

    async def _route_when_back(self, request: RoutedRequest, excluded: set[str]) -> Route | None:
        """The first route that joins within ROUTE_WAIT_S: the request waits out the restart, as a stream
        cut by it does (_resume), rather than failing."""
        deadline = time.monotonic() + ROUTE_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            if self.selector.can_serve_without(excluded):
                return self.selector.pick(request, excluded)
        return None

    # ---- one mixed instance ----------------------------------------------------------------------

    async def _single(self, route: Route, path: str, body: dict, request: RoutedRequest,
                      headers: dict[str, str]) -> Response | Retry:
        instance = route.first
        if (hint := pull_hint(self.kv_index, self.registry, instance, request)) is not None:
            body = {**body, "kv_pull": hint}
        ex = Exchange(self.registry, instance, request.num_tokens, _to_compute(route, request))
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
        if (hint := pull_hint(self.kv_index, self.registry, prefill, request)) is not None:
            p_body["kv_pull"] = hint
        d_body = {**body, "pd": PDRequest(transfer_id=transfer_id, role="decode", prefill_addr=prefill.info.pd_comm,
                                          transport=route.transport).model_dump(exclude_none=True)}
        p_ex = Exchange(self.registry, prefill, request.num_tokens, _to_compute(route, request))
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
            self._count_cached(route, p_task.result().body)
            handed_over = True
            return await self._relay(d_ex, upstream, body.get("stream", False), queue, reader)
        finally:
            if not handed_over:
                p_task.cancel()
                p_task.add_done_callback(close_late_response)
                d_ex.close()
                await cancel_response(d_task)

    async def _resume(self, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                      answer: AnswerSoFar, trace: RequestTrace | None) -> Response | Opened:
        """The rest of the answer from another route; with none in the pool (1P1D, its D died), from
        the first that joins within MIGRATION_WAIT_S (the supervisor restarts the dead one in seconds)."""
        deadline = time.monotonic() + MIGRATION_WAIT_S
        while True:
            excluded = answer.excluded(self.registry)
            if self.selector.can_serve_without(excluded) or time.monotonic() > deadline:
                return await self._open(path, answer.resumed_body(body), answer.resumed_request(request),
                                        headers, excluded, trace=trace)
            await asyncio.sleep(0.25)

    async def _blame(self, p_ex: Exchange, p_task: asyncio.Task, d_failure: Retry) -> Retry:
        """D failed; if P fails too (D may only be reporting P's failure), P is the one to avoid."""
        if not p_task.done():
            await asyncio.wait({p_task}, timeout=BLAME_WINDOW)
        if p_task.done() and (p_failure := _prefill_failure(p_ex, p_task)) is not None:
            return p_failure if isinstance(p_failure, Retry) else Retry(p_ex.instance, p_failure)
        return d_failure

    def _count_cached(self, route: Route, body: bytes) -> None:
        """The prompt tokens the instance that computed the prompt found cached (its answer's usage; streamed
        answers are not read), beside what cache_aware predicted."""
        if route.predicted_cached_tokens is None:
            return
        try:
            usage = json.loads(body)["usage"]
            reported = int(usage["prompt_tokens_details"]["cached_tokens"])
        except (ValueError, KeyError, TypeError):
            return
        self.on_cached(route.predicted_cached_tokens, reported)

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
        rest = whole_events(queue)
        try:  # the first event decides: a failure before it can still be retried elsewhere
            first = await anext(rest, b"")
        except BaseException as e:
            reader.cancel()
            upstream.close()
            ex.close()
            if not isinstance(e, BROKEN):
                raise
            ex.broken(e)
            return Retry(ex.instance, error_response(f"PD error: the instance {ex.instance.url} failed: {e}", 502,
                                                     PD_ERROR))
        if (message := server_error(take_token_ids(first)[0])) is not None:  # e.g. D lost its P mid-transfer
            reader.cancel()
            upstream.close()
            ex.close()
            return Retry(None, error_response(message, 502, PD_ERROR))
        ex.prefilled()
        return Opened(ex, upstream, reader, first, rest)

    async def _relay_stream(self, opened: Opened, answer: AnswerSoFar, path: str, body: dict,
                            request: RoutedRequest, headers: dict[str, str],
                            trace: RequestTrace | None) -> AsyncIterator[bytes]:
        """The client's stream: events as they come; when the instance fails mid-answer, the rest from
        another route (`answer` says where the client is), else an error event."""
        current: Opened | None = opened
        try:
            while current is not None:
                failure = None
                try:
                    async for raw_event in current.events():
                        event, token_ids = take_token_ids(raw_event)
                        if (failure := server_error(event)) is not None:
                            break
                        answer.saw(event, token_ids)
                        yield event
                except BROKEN as e:
                    current.ex.broken(e)
                    failure = f"the {current.ex.instance.role} instance {current.ex.instance.url} failed " \
                              f"mid-answer: {e}"
                finally:
                    current.close(failure)
                if failure is None:
                    return
                instance = current.ex.instance
                current = None
                if answer.finished:  # only the usage chunk can be missing
                    yield DONE
                    return
                if not answer.can_resume:
                    yield error_event(error_body(f"PD error: {failure}", 502, PD_ERROR))
                    return
                answer.failed_on(instance)
                log.warning("resuming a stream after %d tokens without %s: %s", len(answer.token_ids),
                            instance.url, failure[:200])
                began = time.monotonic()
                outcome = await self._resume(path, body, request, headers, answer, trace)
                took = time.monotonic() - began
                self.on_migration(isinstance(outcome, Opened), took)
                if trace is not None:
                    trace.migrated(instance.url, len(answer.token_ids),
                                   outcome.ex.instance.url if isinstance(outcome, Opened) else None)
                if not isinstance(outcome, Opened):
                    yield error_event(error_body(f"PD error: {failure}; resuming it elsewhere failed: "
                                                 f"{response_message(outcome)}", 502, PD_ERROR))
                    return
                log.info("resumed a stream after %d tokens on %s in %.3f s", len(answer.token_ids),
                         outcome.ex.instance.url, took)
                current = outcome
        finally:
            if current is not None:
                current.close()

    async def _read_error(self, upstream: aiohttp.ClientResponse, ex: Exchange) -> Response:
        try:
            content = await ex.guard(upstream.read())
        except BROKEN as e:
            content = json.dumps(error_body(f"the instance failed while answering: {e}", 502)).encode()
        finally:
            upstream.close()
        return Response(content, status_code=upstream.status, media_type="application/json")


def settle(leg: Any, outcome: Response | Opened | Retry) -> None:
    """A traced route's span: a stream's goes on with it; any other ends with its answer."""
    if isinstance(outcome, Opened):
        outcome.leg = leg
    elif isinstance(outcome, Retry):
        leg.failed(response_message(outcome.response))
    else:
        leg.answered(outcome.status_code)


def _to_compute(route: Route, request: RoutedRequest) -> int:
    """The prompt tokens `route.first` computes: all but what cache_aware expects it to find cached."""
    return max(request.num_tokens - (route.predicted_cached_tokens or 0), 0)


def response_message(response: Response) -> str:
    """An error answer's message (OpenAI's body), else its status."""
    try:
        return str(json.loads(bytes(response.body))["error"]["message"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"HTTP {response.status_code}"


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
