"""Seeing a deployment: `pdserve launch --otlp-traces-endpoint` sends every member's spans to a collector (here an
OTLP receiver in the test process), one trace per request: the router's, its route's, and under the route the
prefill and decode instances' spans with their phases; the router's /cluster and `pdserve top` show every member."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.otlp_receiver import OtlpReceiver, Span
from tests.servers import Server, wait_for
from tests.test_launch import Launch

pytestmark = pytest.mark.e2e

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MODEL = "tiny"  # conftest.tiny_model: spans and their parents are what is checked, not the words
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver, tiny_model: list[str]
               ) -> Iterator[Launch]:
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # spans leave each process within 0.1 s (default 5 s)
    try:
        launch = Launch(tmp_path_factory.mktemp("traced"), *tiny_model, "--prefill", "1", "--decode", "1",
                        "--routers", "1", "--pd-policy", "always", "--otlp-traces-endpoint", receiver.url,
                        "--collect-detailed-traces", "--num-gpu-blocks-override", "200", "--max-model-len", "1024")
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    try:
        yield launch
        launch.proc.send_signal(signal.SIGINT)
        assert launch.proc.wait(60) == 130, launch.log()[-3000:]
    finally:
        launch.kill()


def _one(spans: list[Span], **match: object) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, f"{match}: {[(s.service, s.name, s.attributes.get('pdserve.request.part')) for s in spans]}"
    return found[0]


def _instance_span(spans: list[Span], part: str) -> Span:
    (found,) = [s for s in spans if s.attributes.get("pdserve.request.part") == part]
    return found


def _children(spans: list[Span], parent: Span) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        if s.parent_id == parent.span_id:
            out.setdefault(s.name, []).append(s)
    return out


def test_a_pd_request_is_one_trace_router_route_prefill_decode(deployment: Launch, receiver: OtlpReceiver) -> None:
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    chunks = list(stream)
    usage = chunks[-1].usage

    def complete(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == CLIENT_TRACE]
        parts = {s.attributes.get("pdserve.request.part") for s in mine}
        return {"prefill", "decode"} <= parts and any(s.service == "pdserve-router" and s.kind == 2 for s in mine)

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == CLIENT_TRACE]
    root = _one(spans, service="pdserve-router", kind=2)
    assert root.parent_id == CLIENT_SPAN  # the client's trace is continued, under its span
    assert root.name == f"chat {MODEL}"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.max_tokens"] == 12 and root.attributes["pdserve.request.stream"]
    route = _one(spans, service="pdserve-router", name="route")
    assert route.parent_id == root.span_id
    assert route.attributes["pdserve.route.kind"] == "pd" and route.attributes["pdserve.route.transport"]
    assert route.attributes["pdserve.route.prefill_policy"] == "cache_aware"
    assert route.attributes["pdserve.route.predicted_hit_ratio"] >= 0
    assert route.attributes["pdserve.route.cost_blocks"] > 0

    prefill, decode = _instance_span(spans, "prefill"), _instance_span(spans, "decode")
    assert prefill.parent_id == decode.parent_id == route.span_id
    assert prefill.service == decode.service == "pdserve-instance"
    assert route.attributes["pdserve.route.prefill"].endswith(str(prefill.attributes["server.port"]))
    assert route.attributes["pdserve.route.decode"].endswith(str(decode.attributes["server.port"]))
    for s in (prefill, decode):
        assert s.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert s.attributes["gen_ai.request.model"] == MODEL
    assert decode.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 12
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert prefill.attributes["gen_ai.response.finish_reasons"] == ["prefilled"]

    p_phases, d_phases = _children(spans, prefill), _children(spans, decode)
    assert {"queue", "prefill"} <= p_phases.keys() and "decode" not in p_phases
    assert {"kv_wait", "kv_transfer", "decode"} <= d_phases.keys()
    (transfer,) = d_phases["kv_transfer"]
    assert transfer.attributes["pdserve.kv.bytes"] > 0
    assert transfer.attributes["pdserve.kv.transport"] == route.attributes["pdserve.route.transport"]
    assert [s.name for s in spans if s.parent_id == transfer.span_id] == ["kv_write"]
    (decoding,) = d_phases["decode"]
    steps = [s for s in spans if s.parent_id == decoding.span_id and s.name == "step"]
    assert len(steps) >= 10  # --collect-detailed-traces: a span per step (11 tokens decoded after P's first)
    assert all(s.attributes["pdserve.step.tokens"] == 1 for s in steps)
    prefill_steps = p_phases.get("step", [])
    assert sum(s.attributes["pdserve.step.tokens"] for s in prefill_steps) == usage.prompt_tokens
    (prefilling,) = p_phases["prefill"]
    # one timeline: the router's span holds the route's, the route's holds P's prefill and D's decode
    assert root.start <= route.start <= prefilling.start < prefilling.end <= decoding.end <= root.end + 0.05

    # No traceparent: the router starts the trace, and the instances join it
    before = {s.trace_id for s in receiver.spans}
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    new = receiver.wait_for(lambda spans: sum(1 for s in spans if s.trace_id not in before and
                                              s.attributes.get("pdserve.request.part") in ("prefill", "decode")) == 2)
    traces = {s.trace_id for s in new if s.trace_id not in before}
    assert len(traces) == 1
    (trace_id,) = traces
    root = _one(receiver.trace(trace_id), service="pdserve-router", kind=2)
    assert root.parent_id == "" and root.name == f"text_completion {MODEL}"
    assert _instance_span(receiver.trace(trace_id), "decode").attributes["gen_ai.usage.output_tokens"] == \
        answer.usage.completion_tokens


def test_cluster_json_and_pdserve_top_show_every_member(deployment: Launch) -> None:
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="x", max_retries=0, timeout=120)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)

    def cluster() -> dict:
        return httpx.get(f"{deployment.url}/cluster", timeout=10).json()

    def idle(view: dict) -> bool:  # P holds a request until D acknowledges its KV, a moment after the answer
        return all(m["status"]["waiting"] == m["status"]["running"] == m["status"]["in_flight"] == 0
                   for m in view["members"])

    wait_for(lambda: idle(cluster()), 10, "the deployment did not go idle after its requests")
    view = cluster()
    assert view["router"]["can_serve"] and view["router"]["last_minute"]["requests"] >= 1
    members = {m["role"]: m for m in view["members"]}
    assert sorted(members) == ["decode", "prefill"]
    for role, m in members.items():
        status = m["status"]
        assert m["healthy"] and status["role"] == role and status["engine_answered"]
        assert status["kv"]["device"]["blocks"] == 200 and set(status["kv"]) == {"device"}  # no host or disk tier
        assert status["last_minute"]["requests"] >= 1 and status["last_minute"]["ttft_ms"]["p50"] > 0
    assert members["decode"]["status"]["last_minute"]["itl_ms"]["p50"] > 0  # decode streams its tokens

    top = subprocess.run([sys.executable, "-m", "pdserve.cli", "top", "--url", deployment.url, "--once",
                          "--width", "250"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    assert "serving" in lines[0] and "TTFT p50/p90 ms" in top.stdout
    for role, m in members.items():
        (row,) = [line for line in lines if m["url"] in line]
        assert role in row and "healthy" in row and "% of 200" in row


def test_a_stream_resumed_after_its_decode_instance_failed_shows_both_decode_instances(
        deployment: Launch, receiver: OtlpReceiver) -> None:
    """D's worker dies mid-stream: D ends the stream with an error event, exports its span and exits; launch
    restarts it, and the router resumes the stream there. The trace holds both routes, each with its own P and D."""
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    decode = next(i for i in deployment.instances().values() if i["role"] == "decode")
    (worker,) = [p for p in psutil.Process(decode["pid"]).children(recursive=True)
                 if "pdserve.worker" in " ".join(p.cmdline())]
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True},
                                       extra_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 5:
            worker.kill()
    assert chunks[-1].usage.completion_tokens == 60  # the answer came whole, across the two decode instances
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    def both_routes_done(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return (sum(s.attributes.get("pdserve.request.part") == "decode" for s in mine) == 2
                and any(s.kind == 2 and s.service == "pdserve-router" for s in mine))

    spans = [s for s in receiver.wait_for(both_routes_done, timeout=60) if s.trace_id == trace_id]
    root = _one(spans, service="pdserve-router", kind=2)
    routes = sorted((s for s in spans if s.name == "route"), key=lambda s: s.start)
    assert len(routes) == 2 and routes[0].error and not routes[1].error
    decodes = sorted((s for s in spans if s.attributes.get("pdserve.request.part") == "decode"), key=lambda s: s.start)
    assert [d.parent_id for d in decodes] == [r.span_id for r in routes]
    failed, resumed = decodes
    assert failed.error and not resumed.error
    assert resumed.attributes["pdserve.migration.resumed_tokens"] >= 4
    assert resumed.attributes["gen_ai.usage.output_tokens"] == 60  # the resumed part counts what came before
    prefills = [s for s in spans if s.attributes.get("pdserve.request.part") == "prefill"]
    assert sorted(p.parent_id for p in prefills) == sorted(r.span_id for r in routes)  # each route's own P
    (migration,) = [e for e in root.events if e[0] == "migration"]
    assert migration[1]["pdserve.migration.tokens"] >= 4
    wait_for(lambda: deployment.rejoined(decode["url"], 1), 60, "the decode instance did not rejoin")


def test_tracing_off_exports_nothing_even_when_the_variables_point_at_a_collector(tmp_path: Path,
                                                                                 receiver: OtlpReceiver,
                                                                                 tiny_model: list[str]) -> None:
    """No --otlp-traces-endpoint: no span leaves the process, whatever OTEL_* variables say."""
    posts = receiver.posts
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url, "OTEL_TRACES_EXPORTER": "otlp",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    server = Server(tmp_path / "plain", *tiny_model, "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                    env=env)
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                       headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, timeout=60)
        assert r.status_code == 200
    finally:
        server.stop()
    assert receiver.posts == posts
