"""Tracing's parts without a model: OTLP export over both protocols, the instance's phase spans from the engine's
times, a route's attributes, and a router's trace of a stream resumed on another instance (stand-in instances)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import openai
import pytest
import yaml

from pdserve.api.settings import ServerSettings
from pdserve.api.tracing import InstanceTracing
from pdserve.balancing.policies import RoutedRequest
from pdserve.config.flags import add_flags
from pdserve.engine.messages import RequestTimes, StepTime
from pdserve.http.wire import Registration
from pdserve.router.prefill_decider import Decision
from pdserve.router.registry import Instance
from pdserve.router.selector import Route
from pdserve.router.tracing import RouterTracing, route_attributes
from pdserve.tracing.setup import (
    STOP_FLUSH_S,
    Tracing,
    TracingUnavailable,
    check_endpoint,
    export_protocol,
    http_traces_url,
    start_tracing,
)
from tests.otlp_receiver import OtlpReceiver
from tests.servers import Router, wait_for
from tests.stub_instance import StubInstance


@pytest.fixture
def receiver() -> OtlpReceiver:
    r = OtlpReceiver(grpc=True)
    yield r
    r.close()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_reach_a_collector_over_either_protocol(receiver: OtlpReceiver, protocol: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    endpoint = receiver.grpc_url if protocol == "grpc" else receiver.url
    tracing = start_tracing(endpoint, "pdserve-test", "127.0.0.1:1")  # not contacted
    tracing.tracer.start_span("hello", attributes={"gen_ai.request.model": "m"}).end()
    tracing.shutdown()  # exports what is batched
    (span,) = receiver.spans
    assert (span.service, span.name, span.attributes) == ("pdserve-test", "hello", {"gen_ai.request.model": "m"})


def test_the_sdk_sampler_variables_decide_which_requests_are_traced(receiver: OtlpReceiver,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # no trace of its own; a sampled parent's children are
    instance = InstanceTracing(start_tracing(receiver.url, "pdserve-test", "x"), "127.0.0.1", 9)  # not contacted
    assert instance.start({}, Body(), "chat", "a", 1.0, "whole") is None
    sampled = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    span = instance.start(sampled, Body(), "chat", "b", 1.0, "whole")
    assert span is not None
    span.finish(None, {}, None, 2.0)
    instance.tracing.shutdown()
    (exported,) = receiver.spans
    assert exported.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and exported.parent_id == "00f067aa0ba902b7"


def test_a_collector_that_is_down_holds_a_stop_at_most_two_seconds(caplog: pytest.LogCaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    dead = "http://127.0.0.1:9/v1/traces"  # nothing listens on the discard port
    tracing = start_tracing(dead, "pdserve-test", "x")
    tracing.tracer.start_span("lost").end()
    time.sleep(0.2)  # the export is retrying by now
    began = time.monotonic()
    tracing.shutdown()
    assert time.monotonic() - began < STOP_FLUSH_S + 0.5  # the SDK alone waits out its 10 s export timeout
    assert "were not exported" in caplog.text and dead in caplog.text


def test_collect_detailed_traces_takes_vllms_values_or_none() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, ServerSettings)
    parse = parser.parse_args
    assert parse([]).collect_detailed_traces is None
    assert parse(["--collect-detailed-traces"]).collect_detailed_traces == "all"
    assert parse(["--collect-detailed-traces", "--port", "9"]).collect_detailed_traces == "all"
    assert parse(["--collect-detailed-traces", "model,worker"]).collect_detailed_traces == "model,worker"
    with pytest.raises(argparse.ArgumentError, match="give model, worker, all"):
        parse(["--collect-detailed-traces", "gpu"])


def test_protocol_and_endpoint_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    assert export_protocol("http://collector:4318") == "http/protobuf"  # not contacted
    assert export_protocol("grpc://collector:4317") == "grpc"  # not contacted
    assert http_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"  # not contacted
    assert http_traces_url("http://collector:4318/custom") == "http://collector:4318/custom"  # not contacted
    for bad in ("collector:4318", "ftp://collector/x", "http://"):  # not contacted
        with pytest.raises(TracingUnavailable, match="URL of an OTLP collector"):
            start_tracing(bad, "pdserve-test", "x")
    check_endpoint("collector:4317", "grpc")  # gRPC's usual form, host:port; not contacted
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(TracingUnavailable, match="http/json"):
        export_protocol("http://collector:4318")  # not contacted


def _provider_spans() -> tuple[Tracing, list]:
    """A tracer whose spans are kept in memory (the SDK's own exporter for tests)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


class Body:
    model, temperature, max_tokens, stream = "m", 0, 8, True


def test_a_mixed_request_spans_its_queue_prefill_and_decode_with_preemptions_and_steps() -> None:
    tracing, exporter = _provider_spans()
    instance = InstanceTracing(tracing, "127.0.0.1", 9, detailed=True)  # not contacted
    span = instance.start({}, Body(), "chat.completion", "chatcmpl-1", 100.0, "whole")
    times = RequestTimes(arrival=100.0, first_scheduled=100.5, first_token=101.0, last_token=102.0, finished=102.0,
                         preempted=[101.5], steps=[StepTime(100.5, 101.0, 40), StepTime(101.0, 101.2, 1),
                                                   StepTime(101.6, 102.0, 1)])
    span.finish(times, {"gen_ai.usage.output_tokens": 3}, None, 102.1)
    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "step"}
    root = spans["chat m"]
    assert root.attributes["gen_ai.request.temperature"] == 0.0 and root.attributes["gen_ai.usage.output_tokens"] == 3
    assert (root.start_time, root.end_time) == (100_000_000_000, 102_100_000_000)
    for name, (start, end) in {"queue": (100.0, 100.5), "prefill": (100.5, 101.0), "decode": (101.0, 102.0)}.items():
        assert spans[name].parent.span_id == root.context.span_id
        assert (spans[name].start_time, spans[name].end_time) == (int(start * 1e9), int(end * 1e9))
    assert [e.name for e in spans["decode"].events] == ["preempted"]
    steps = [s for s in exporter.get_finished_spans() if s.name == "step"]
    parents = sorted((s.attributes["pdserve.step.tokens"], s.parent.span_id) for s in steps)
    assert parents == sorted([(40, root.context.span_id), (1, spans["decode"].context.span_id),
                              (1, spans["decode"].context.span_id)])


def test_a_decode_request_spans_its_kv_transfer_and_an_unsampled_one_costs_nothing() -> None:
    tracing, exporter = _provider_spans()
    instance = InstanceTracing(tracing, "127.0.0.1", 9)  # not contacted
    span = instance.start({}, Body(), "text_completion", "cmpl-1", 10.0, "decode")
    times = RequestTimes(arrival=10.0, preallocated=10.1, cache_info_sent=10.1, first_layer_written=10.3,
                         last_layer_written=10.6, prefill_done_received=10.7, buffered=10.7, swap_started=10.8,
                         swapped_in=10.9, first_token=10.9, finished=11.5, kv_bytes=4096, kv_protocol="ipc")
    span.finish(times, {}, "abort", 11.6)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"text_completion m", "kv_wait", "kv_transfer", "kv_write", "kv_buffer_wait", "kv_swap_in",
                          "decode"}
    assert spans["kv_transfer"].attributes == {"pdserve.kv.bytes": 4096, "pdserve.kv.transport": "ipc"}
    assert spans["kv_write"].parent.span_id == spans["kv_transfer"].context.span_id
    assert spans["decode"].start_time == int(10.9 * 1e9)  # decoding starts once the KV is in the cache
    root = spans["text_completion m"]
    assert root.status.status_code.name == "ERROR" and root.attributes["error.type"] == "abort"

    sampled_out = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"  # flags 00: not sampled
    assert instance.start({"traceparent": sampled_out}, Body(), "chat", "x", 1.0, "whole") is None


P_URL, D_URL = "http://127.0.0.1:1", "http://127.0.0.1:2"  # not contacted


def _instance(url: str, role: str) -> Instance:
    return Instance(Registration(role=role, url=url, model="m"))


def test_route_attributes_say_what_was_chosen_and_why() -> None:
    owner = RouterTracing(_provider_spans()[0], "cache_aware", "least_requests")
    request = RoutedRequest(token_ids=None, num_tokens=200, route_cost=3.5)
    prefill, decode = _instance(P_URL, "prefill"), _instance(D_URL, "decode")
    pd = Route(prefill, decode, "ipc", predicted_cached_tokens=150)
    attributes = route_attributes(pd, request, owner)
    assert attributes["pdserve.route.kind"] == "pd" and attributes["pdserve.route.decode"] == D_URL
    assert attributes["pdserve.route.predicted_hit_ratio"] == 0.75 and attributes["pdserve.route.cost_blocks"] == 3.5
    local = Route(decode, decision=Decision(True, "short", 40))
    attributes = route_attributes(local, RoutedRequest(token_ids=None, num_tokens=50), owner)
    assert (attributes["pdserve.route.kind"], attributes["pdserve.route.reason"]) == ("local_prefill", "short")
    assert attributes["pdserve.route.uncached_tokens"] == 40 and "pdserve.route.decode" not in attributes


def _traceparent(headers: dict) -> str:
    return {k.lower(): v for k, v in headers.items()}["traceparent"]


def _parent_of(headers: dict) -> str:
    return _traceparent(headers).split("-")[2]


@pytest.mark.e2e
def test_a_resumed_stream_shows_both_instances_under_routes_of_one_trace(tmp_path: Path,
                                                                         receiver: OtlpReceiver) -> None:
    alpha, beta = StubInstance("alpha"), StubInstance("beta")
    for stub in (alpha, beta):
        stub.story, stub.cut_after = ["Once", " upon", " a", " time"], 2  # the first to answer dies after 2 words
    listing = tmp_path / "instances.yaml"
    listing.write_text(yaml.safe_dump({"instances": [alpha.registration(), beta.registration()]}))
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        router = Router(tmp_path / "router", "--instances", str(listing), "--tokenizer", "none",
                        "--health-interval", "0.2", "--otlp-traces-endpoint", receiver.url)
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    try:
        wait_for(lambda: len(router.healthy_urls()) == 2, 10, "the static instances were not probed")
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=30)
        chunks = list(client.completions.create(model="stub", prompt="hi", max_tokens=4, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == "Once upon a time"
        spans = receiver.wait_for(lambda s: any(x.kind == 2 for x in s))
        (root,) = [s for s in spans if s.kind == 2]
        routes = sorted((s for s in spans if s.name == "route"), key=lambda s: s.start)
        assert [r.parent_id for r in routes] == [root.span_id] * 2
        first, second = sorted((alpha, beta), key=lambda s: len(s.requests[0]["migration"].get("token_ids", [])))
        assert [r.attributes["pdserve.route.instance"] for r in routes] == [first.url, second.url]
        assert routes[0].error and not routes[1].error  # the cut one failed, the resumed one answered
        # each instance was told its route's span as the parent of its own
        assert [_parent_of(s.headers[0]) for s in (first, second)] == [r.span_id for r in routes]
        assert {_traceparent(s.headers[0]).split("-")[1] for s in (first, second)} == {root.trace_id}
        (event,) = [e for e in root.events if e[0] == "migration"]
        assert event[1] == {"pdserve.migration.failed": first.url, "pdserve.migration.tokens": 2,
                            "pdserve.migration.resumed_on": second.url}
        assert not root.error and root.attributes["http.response.status_code"] == 200
    finally:
        router.stop()
        alpha.close()
        beta.close()
