"""A router's spans: one per request, continued from the client's `traceparent` or starting the trace, and a child
per route tried. Each route's span is the parent of the instances' spans: its `traceparent` goes to P and D with
the request, so a PD request's trace is router -> route -> prefill instance and decode instance, and a stream
resumed elsewhere shows each decode instance under a route of its own.

    {operation} {model}          the request (SERVER): admission, retries, migrations as events; the status sent
      route                      one try (CLIENT): the instances, transport, policy, why, cost, predicted cache hits
        ... the instances' spans (api/tracing.py)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from pdserve.balancing.policies import RoutedRequest
from pdserve.router.selector import Route
from pdserve.tracing import genai
from pdserve.tracing.propagation import context_from, headers_for
from pdserve.tracing.setup import Tracing


@dataclass
class RouterTracing:
    """--otlp-traces-endpoint on a router."""

    tracing: Tracing
    prefill_policy: str
    decode_policy: str

    def start(self, headers: Mapping[str, str], path: str, body: Mapping[str, Any], request_id: str,
              address: str, port: int) -> RequestTrace | None:
        """The request's span, or None when its trace is not sampled."""
        attributes = genai.request_attributes(path, body)
        attributes.update({genai.SERVER_ADDRESS: address, genai.SERVER_PORT: port, "pdserve.request.id": request_id,
                           "pdserve.request.stream": bool(body.get("stream"))})
        span = self.tracing.tracer.start_span(
            genai.span_name(attributes[genai.OPERATION], attributes.get(genai.REQUEST_MODEL)),
            context=context_from(headers), kind=SpanKind.SERVER, attributes=attributes)
        return RequestTrace(self, span) if span.is_recording() else None


@dataclass
class RequestTrace:
    owner: RouterTracing
    span: Any

    def admitted(self, avoided: set[str]) -> None:
        self.span.set_attribute("pdserve.admission", "admitted")
        if avoided:
            self.span.set_attribute("pdserve.admission.avoided", sorted(avoided))

    def refused(self, message: str) -> None:
        self.span.set_attributes({"pdserve.admission": "refused", "pdserve.admission.reason": message})

    def route(self, route: Route, request: RoutedRequest, attempt: int) -> RouteSpan:
        attributes = route_attributes(route, request, self.owner)
        attributes["pdserve.route.attempt"] = attempt
        span = self.owner.tracing.tracer.start_span("route", context=set_span_in_context(self.span),
                                                    kind=SpanKind.CLIENT, attributes=attributes)
        return RouteSpan(span)

    def retried(self, failed: str | None, attempt: int) -> None:
        self.span.add_event("retry", {"pdserve.retry.failed": failed or "", "pdserve.retry.attempt": attempt})

    def migrated(self, failed: str, tokens: int, resumed_on: str | None) -> None:
        self.span.add_event("migration", {"pdserve.migration.failed": failed, "pdserve.migration.tokens": tokens,
                                          "pdserve.migration.resumed_on": resumed_on or ""})

    def end(self, status: int, error: str | None = None) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400 or error:
            self.span.set_attribute(genai.ERROR_TYPE, str(status) if status >= 400 else "stream_error")
            self.span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        self.span.end()

    async def until_streamed(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A streamed answer's events; the span ends with the stream (an error event marks it failed)."""
        error = None
        try:
            async for event in events:
                if event.startswith(b'data: {"error"'):
                    error = event[6:300].decode(errors="replace")
                yield event
        finally:
            self.end(200, error)


@dataclass
class RouteSpan:
    span: Any

    @property
    def headers(self) -> dict[str, str]:
        return headers_for(self.span)

    def failed(self, message: str) -> None:
        self.span.set_status(Status(StatusCode.ERROR, message[:300]))
        self.span.end()

    def answered(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        self.span.end()


def route_attributes(route: Route, request: RoutedRequest, owner: RouterTracing) -> dict[str, Any]:
    """What the selector chose and why, as span attributes."""
    if route.decode is not None:
        kind, reason = "pd", "pair"
    elif route.decision is not None:
        kind, reason = "local_prefill", route.decision.reason
    else:
        kind, reason = "whole", "single" if request.single else "no pair"
    attributes: dict[str, Any] = {"pdserve.route.kind": kind, "pdserve.route.reason": reason,
                                  "pdserve.route.instance": route.first.url,
                                  "pdserve.route.prefill_policy": owner.prefill_policy,
                                  "pdserve.route.decode_policy": owner.decode_policy,
                                  "pdserve.request.prompt_tokens": request.num_tokens}
    if route.decode is not None:
        attributes.update({"pdserve.route.prefill": route.first.url, "pdserve.route.decode": route.decode.url,
                           "pdserve.route.transport": route.transport or ""})
    if route.predicted_cached_tokens is not None:
        attributes["pdserve.route.predicted_cached_tokens"] = route.predicted_cached_tokens
        if request.num_tokens:
            attributes["pdserve.route.predicted_hit_ratio"] = route.predicted_cached_tokens / request.num_tokens
    if request.route_cost is not None:
        attributes["pdserve.route.cost_blocks"] = request.route_cost
    if route.decision is not None:
        attributes["pdserve.route.uncached_tokens"] = route.decision.uncached_tokens
    return attributes
