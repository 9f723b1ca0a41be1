"""An OTLP trace receiver in the test process: a collector's HTTP/protobuf endpoint (POST /v1/traces) and,
when asked, its gRPC TraceService, decoding what arrives with opentelemetry-proto into plain `Span`s."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int  # opentelemetry.proto's SpanKind: 2 server, 3 client
    start: float
    end: float
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    error: bool = False


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                spans.append(Span(
                    str(resource.get("service.name")), s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                    s.name, s.kind, s.start_time_unix_nano / 1e9, s.end_time_unix_nano / 1e9,
                    {a.key: _value(a.value) for a in s.attributes},
                    [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                    s.status.code == 2))
    return spans


class OtlpReceiver:
    """Spans received so far in `spans`; `url` is the HTTP endpoint, `grpc_url` the gRPC one (grpc=True)."""

    def __init__(self, grpc: bool = False) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver._add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"
        self._grpc = self._start_grpc() if grpc else None

    def _start_grpc(self) -> Any:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                receiver._add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.grpc_url = f"grpc://127.0.0.1:{port}"
        return server

    def _add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.posts += 1
            self.spans.extend(decode(request))

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[Span]:
        """The spans once `predicate(spans)` holds; fails with what arrived when it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.1)
        raise AssertionError(f"the spans never showed what was expected; got {[(s.service, s.name) for s in spans]}")

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(0)
