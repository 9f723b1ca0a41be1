"""W3C trace context (`traceparent`, `tracestate`) in and out of HTTP headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def context_from(headers: Mapping[str, str]) -> Any:
    """The caller's trace context (None: the span starts a trace of its own)."""
    if "traceparent" not in headers:
        return None
    return _PROPAGATOR.extract({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})


def headers_for(span: Any) -> dict[str, str]:
    """The headers that make the receiver's spans children of `span`."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier
