"""One instance's span per request, continued from the caller's `traceparent` (the router's, or a client's).

The engine sends its moments with a request's final output (`RequestTimes`); the spans of the request's phases
are made from them when the request ends, with those times. So the engine process never imports OpenTelemetry,
and a request whose trace is not sampled costs one check.

    {operation} {model}                 the request on this instance (SERVER), GenAI attributes
      queue                             arrival -> first scheduled (prefill and mixed)
      prefill                           first scheduled -> first token
      kv_transfer                       decode: its cache info sent -> the prefill instance's "done" (bytes, transport)
        kv_write                        ... the prefill instance's first -> last layer written (its clock)
      kv_buffer_wait, kv_swap_in        decode with a splitwise cache buffer
      decode                            first token -> finished (mixed and decode); an event per preemption
        step ...                        --collect-detailed-traces: each engine step that computed the request
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from pdserve.engine.messages import RequestTimes
from pdserve.tracing import genai
from pdserve.tracing.propagation import context_from
from pdserve.tracing.setup import Tracing

REQUEST_FIELDS = ("model", "temperature", "top_p", "seed", "n", "max_tokens", "max_completion_tokens",
                  "max_output_tokens")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class InstanceTracing:
    """--otlp-traces-endpoint on an instance."""

    tracing: Tracing
    address: str
    port: int
    detailed: bool = False  # --collect-detailed-traces: a span per engine step

    def start(self, headers: Mapping[str, str], body: Any, kind: str, request_id: str, started: float,
              part: str) -> RequestSpan | None:
        """The request's span from `started` (unix seconds), or None when its trace is not sampled.
        `part`: what this instance does for it (prefill, decode, or whole)."""
        fields = {name: getattr(body, name, None) for name in REQUEST_FIELDS}
        attributes = genai.request_attributes("", fields)
        attributes[genai.OPERATION] = "text_completion" if kind == "text_completion" else "chat"  # respond()'s kinds
        attributes.update({genai.SERVER_ADDRESS: self.address, genai.SERVER_PORT: self.port,
                           "pdserve.request.part": part, "pdserve.request.id": request_id,
                           "pdserve.request.stream": bool(getattr(body, "stream", False))})
        span = self.tracing.tracer.start_span(
            genai.span_name(attributes[genai.OPERATION], attributes.get(genai.REQUEST_MODEL)),
            context=context_from(headers), kind=SpanKind.SERVER, attributes=attributes, start_time=ns(started))
        if not span.is_recording():
            return None
        return RequestSpan(self.tracing.tracer, span, part, self.detailed)


@dataclass
class RequestSpan:
    tracer: Any
    span: Any
    part: str  # prefill, decode, whole
    detailed: bool

    def finish(self, times: RequestTimes | None, attributes: dict[str, Any], error: str | None,
               ended: float) -> None:
        """End the span at `ended`, with the phases the engine's `times` show (None: it never reached the engine)."""
        span = self.span
        span.set_attributes(attributes)
        if error is not None:
            span.set_attribute(genai.ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR, error))
        if times is not None:
            self._phases(times)
        span.end(end_time=ns(ended))

    def _phases(self, t: RequestTimes) -> None:
        decoding_from = t.first_token
        if self.part == "decode":
            self._kv_phases(t)
            decoding_from = t.swapped_in or t.prefill_done_received or t.first_token
        else:
            self._child("queue", t.arrival, t.first_scheduled)
            self._child("prefill", t.first_scheduled, t.first_token)
        preempted = [("preempted", moment) for moment in t.preempted]
        decode = self._child("decode", decoding_from, t.finished, events=preempted) if self.part != "prefill" else None
        if decode is None:
            for name, moment in preempted:
                self.span.add_event(name, timestamp=ns(moment))
        if t.first_token is not None:
            self.span.add_event("first_token", timestamp=ns(t.first_token))
        if self.detailed and t.steps:
            for step in t.steps:
                parent = decode if decode is not None and decoding_from is not None \
                    and step.started >= decoding_from else None
                self._child("step", step.started, step.ended, {"pdserve.step.tokens": step.num_tokens}, parent)

    def _kv_phases(self, t: RequestTimes) -> None:
        self._child("kv_wait", t.arrival, t.preallocated)
        transfer = self._child("kv_transfer", t.cache_info_sent, t.prefill_done_received,
                               {"pdserve.kv.bytes": t.kv_bytes or 0, "pdserve.kv.transport": t.kv_protocol or ""})
        if transfer is not None:
            self._child("kv_write", t.first_layer_written, t.last_layer_written, parent=transfer)
        self._child("kv_buffer_wait", t.buffered, t.swap_started)
        self._child("kv_swap_in", t.swap_started, t.swapped_in)

    def _child(self, name: str, start: float | None, end: float | None, attributes: dict | None = None,
               parent: Any = None, events: list[tuple[str, float]] = ()) -> Any:
        """A child span from `start` to `end` (left out when either is unknown), with events at their moments."""
        if start is None or end is None:
            return None
        child = self.tracer.start_span(name, context=set_span_in_context(parent or self.span),
                                       attributes=attributes, start_time=ns(start))
        for event, moment in events:
            child.add_event(event, timestamp=ns(moment))
        child.end(end_time=ns(max(end, start)))
        return child
