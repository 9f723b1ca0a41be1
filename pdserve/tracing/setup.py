"""A process's tracer: OTLP over HTTP/protobuf or gRPC, spans batched off the request path.

Sampling is the OpenTelemetry SDK's own, from the standard variables (OTEL_TRACES_SAMPLER=parentbased_traceidratio,
OTEL_TRACES_SAMPLER_ARG=0.1): a router samples a trace, and the instances follow the sampled flag it passes on.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("pdserve.tracing")

PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("http/protobuf", "grpc")
ENDPOINT_HELP = ("send OpenTelemetry traces there (OTLP; http/protobuf, or gRPC for a grpc:// URL or with "
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc); sampled by OTEL_TRACES_SAMPLER; needs pdserve[otel]")
INSTALL_HINT = "tracing needs the OpenTelemetry SDK and OTLP exporters: pip install 'pdserve[otel]'"


class TracingUnavailable(ValueError):
    """--otlp-traces-endpoint was given, but it cannot be served (no SDK, an unknown protocol)."""


DETAILED_MODULES = ("model", "worker", "all")  # vLLM's --collect-detailed-traces values


def detailed_trace_modules(text: str) -> str:
    """--collect-detailed-traces MODULES, checked: a comma-separated list of vLLM's module names."""
    modules = [m.strip() for m in text.split(",") if m.strip()]
    if not modules or any(m not in DETAILED_MODULES for m in modules):
        raise argparse.ArgumentTypeError(f"{text!r}: give {', '.join(DETAILED_MODULES)} (comma-separated)")
    return ",".join(modules)


def export_protocol(endpoint: str) -> str:
    """The standard variables decide; without them a grpc:// endpoint means gRPC, any other HTTP/protobuf."""
    for env in PROTOCOL_ENVS:
        if value := os.environ.get(env):
            if value not in PROTOCOLS:
                raise TracingUnavailable(f"{env}={value!r}: pdserve exports traces over {' or '.join(PROTOCOLS)}")
            return value
    return "grpc" if urlsplit(endpoint).scheme == "grpc" else "http/protobuf"


def check_endpoint(endpoint: str, protocol: str) -> None:
    """A URL with a host: http(s):// for OTLP/HTTP; for gRPC also grpc:// or a bare host:port."""
    parts = urlsplit(endpoint if "://" in endpoint or protocol != "grpc" else f"grpc://{endpoint}")
    schemes = ("http", "https", "grpc") if protocol == "grpc" else ("http", "https")
    if parts.scheme not in schemes or not parts.hostname:
        example = "grpc://collector:4317" if protocol == "grpc" else "http://collector:4318"
        raise TracingUnavailable(f"--otlp-traces-endpoint {endpoint!r} is not the URL of an OTLP collector "
                                 f"({protocol}; e.g. {example})")


def http_traces_url(endpoint: str) -> str:
    """An endpoint given without a path is a collector's base address: traces go to its /v1/traces."""
    parts = urlsplit(endpoint)
    return endpoint.rstrip("/") + "/v1/traces" if parts.path in ("", "/") else endpoint


STOP_FLUSH_S = 2.0  # at stop, what is batched gets this long to leave: a collector that is down must not hold it


class Tracing:
    """The process's tracer and the provider behind it."""

    def __init__(self, provider: Any, endpoint: str = "") -> None:
        self.provider, self.endpoint = provider, endpoint
        self.tracer = provider.get_tracer("pdserve")

    def shutdown(self) -> None:
        """Export what is still batched, for at most STOP_FLUSH_S. The SDK's own shutdown waits out an export's
        retries (up to the exporter's 10 s timeout, and neither its flush nor its shutdown timeout cuts that
        short), so it runs in a thread the stop does not wait for longer."""
        stopper = threading.Thread(target=self.provider.shutdown, name="pdserve-tracing-stop", daemon=True)
        stopper.start()
        stopper.join(STOP_FLUSH_S)
        if stopper.is_alive():
            log.warning("tracing: spans still batched were not exported within %.0f s of the stop (is the "
                        "collector at %s up?)", STOP_FLUSH_S, self.endpoint)


def start_tracing(endpoint: str, service_name: str, instance_id: str) -> Tracing:
    """Spans exported to `endpoint` as `service_name` (OTEL_SERVICE_NAME overrides it)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise TracingUnavailable(f"{INSTALL_HINT} ({e})") from None
    protocol = export_protocol(endpoint)
    check_endpoint(endpoint, protocol)
    exporter = _exporter(protocol, endpoint)
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    resource = Resource.create({"service.name": name, "service.instance.id": instance_id})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing: spans of %s go to %s over %s", name, endpoint, protocol)
    return Tracing(provider, endpoint)


def _exporter(protocol: str, endpoint: str) -> Any:
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            parts = urlsplit(endpoint if "://" in endpoint else f"grpc://{endpoint}")
            return GrpcExporter(endpoint=parts.netloc, insecure=parts.scheme != "https")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=http_traces_url(endpoint))
    except ImportError as e:
        raise TracingUnavailable(f"{INSTALL_HINT} ({e})") from None
