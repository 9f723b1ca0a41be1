"""Forwarding one OpenAI request to its route, with failover: the attempt loop.

Until the first event goes to the client (for a non-streamed answer: until the whole answer is in),
a failed instance (unreachable, lost from the pool, 5xx, 429, a 5xx error event) is excluded and the
request is tried again on another route, at most `max_retries` times. After that, a streamed answer
that breaks is resumed on another route where it stopped (stream_relay.py, migration.py), at most
`migration_limit` times, and then ends with an error event. One try of a mixed route is `_single`, of a
PD pair pd_pair.py; an answer is passed through by relay.py. Every exchange is tied to its instance: when
the registry loses the instance (failed probes, a connection error seen by another request, expiry), the
exchange ends at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
from fastapi.responses import Response, StreamingResponse

from pdserve.balancing.policies import RoutedRequest
from pdserve.http.wire import SENT_HEADER
from pdserve.kv_events.index import KVIndex
from pdserve.router.exchange import BROKEN, Exchange
from pdserve.router.kv_pull import pull_hint
from pdserve.router.migration import AnswerSoFar, can_migrate
from pdserve.router.outcome import Opened, Outcome, Retry, error_response, settle
from pdserve.router.pd_pair import PairForwarder
from pdserve.router.registry import Registry
from pdserve.router.relay import relay
from pdserve.router.selector import Route, Selector
from pdserve.router.stream_relay import StreamRelay

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from pdserve.router.tracing import RequestTrace

log = logging.getLogger("pdserve.router")

MIGRATION_WAIT_S = 30.0  # how long a broken stream waits for a route to resume on
ROUTE_WAIT_S = 30.0  # how long a new request waits for a route when the pool lost its last one
OUTAGE_MEMORY_S = 120.0  # ... if the pool had one this recently (else it answers 503 at once)

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
        self.pairs = PairForwarder(client, registry, kv_index, self._count_cached)

    async def forward(self, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                      avoid: set[str] | None = None, trace: RequestTrace | None = None) -> Response:
        """`avoid`: instances the first try does not route to (admission's: they would miss an SLO); once the
        request was admitted and a route failed it, any working instance is better than none."""
        answer = AnswerSoFar(self.migration_limit if can_migrate(path, body, self.migration_limit) else 0)
        if answer.limit:
            body = {**body, "migration": {}}  # instances name each event's tokens
        outcome = await self._open(path, body, request, headers, set(), avoid or set(), trace)
        if isinstance(outcome, Opened):
            resume = lambda: self._resume(path, body, request, headers, answer, trace)  # noqa: E731
            relay_stream = StreamRelay(answer, resume, self.on_migration, trace)
            return StreamingResponse(relay_stream.events(outcome), media_type="text/event-stream")
        return outcome

    async def _open(self, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                    excluded: set[str], avoid: frozenset[str] | set[str] = frozenset(),
                    trace: RequestTrace | None = None) -> Outcome:
        """The request on the first route that works, trying others while nothing reached the client."""
        last: Response | None = None
        for attempt in range(self.max_retries + 1):
            route = self.selector.pick(request, excluded | avoid if attempt == 0 else excluded)
            if route is None and attempt == 0 and self._lost_its_routes():
                route = await self._route_when_back(request, excluded)
            if route is None:
                break
            outcome = await self._try(route, path, body, request, headers, attempt, trace)
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

    async def _try(self, route: Route, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                   attempt: int, trace: RequestTrace | None) -> Outcome:
        """One route, traced as its own span when the request is."""
        self.routed_at = time.monotonic()
        self.on_route(route, request)
        hop = {**headers, SENT_HEADER: request.sent_tag} if request.sent_tag else headers
        span = trace.route(route, request, attempt) if trace is not None else None
        if span is not None:
            hop = {**hop, **span.headers}
        try:
            if route.decode is None:
                outcome = await self._single(route, path, body, request, hop)
            else:
                outcome = await self.pairs.forward(route, path, body, request, hop, _to_compute(route, request))
        except BaseException:  # the client hung up
            if span is not None:
                span.failed("the client left")
            raise
        if span is not None:
            settle(span, outcome)
        return outcome

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
                      headers: dict[str, str]) -> Outcome:
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
        outcome = await relay(ex, upstream, body.get("stream", False))
        if isinstance(outcome, Response):
            self._count_cached(route, outcome.body)
        return outcome

    async def _resume(self, path: str, body: dict, request: RoutedRequest, headers: dict[str, str],
                      answer: AnswerSoFar, trace: RequestTrace | None) -> Outcome:
        """The rest of the answer from another route; with none in the pool (1P1D, its D died), from
        the first that joins within MIGRATION_WAIT_S (the supervisor restarts the dead one in seconds)."""
        deadline = time.monotonic() + MIGRATION_WAIT_S
        while True:
            excluded = answer.excluded(self.registry)
            if self.selector.can_serve_without(excluded) or time.monotonic() > deadline:
                return await self._open(path, answer.resumed_body(body), answer.resumed_request(request),
                                        headers, excluded, trace=trace)
            await asyncio.sleep(0.25)

    def _count_cached(self, route: Route, body: bytes) -> None:
        """The prompt tokens the instance that computed the prompt found cached (its answer's usage; streamed
        answers are not read), beside what cache_aware predicted."""
        if route.predicted_cached_tokens is None:
            return
        try:
            reported = int(json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"])
        except (ValueError, KeyError, TypeError):
            return
        self.on_cached(route.predicted_cached_tokens, reported)


def _to_compute(route: Route, request: RoutedRequest) -> int:
    """The prompt tokens `route.first` computes: all but what cache_aware expects it to find cached."""
    return max(request.num_tokens - (route.predicted_cached_tokens or 0), 0)
