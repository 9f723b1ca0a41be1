"""The router without a model: policies, pairing rules and health bookkeeping in process; membership,
security and failover against a real router process and stand-in instances (tests/stub_instance.py)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from pdserve.admission.load import LoadReport
from pdserve.balancing.policies import CacheAware, LeastRequests, LeastTokens, PowerOfTwo, RoundRobin, RoutedRequest
from pdserve.http.wire import Registration
from pdserve.router.prefill_decider import PrefillDecider
from pdserve.router.registry import Instance, Registry
from pdserve.router.selector import Route, Selector, compatible, pair_transport
from pdserve.utils.cluster_auth import SIGNATURE_HEADER, sign_body
from tests.servers import Router, register, wait_for
from tests.stub_instance import StubInstance

SECRET = "s3cret-of-the-cluster"
API_KEY = "sk-router-test"
KEY = "SmolLM2|block=16|dtype=float32|layers=30|kv_heads=3|head_dim=64"


def _instance(url: str, role: str = "prefill", requests: int = 0, tokens: int = 0, **info: object) -> Instance:
    i = Instance(Registration(role=role, url=url, block_size=4, **info), healthy=True)
    i.in_flight_requests, i.in_flight_tokens = requests, tokens
    return i


# ---- policies and pairing (in process) ---------------------------------------------------------

def test_load_policies_pick_the_least_loaded() -> None:
    a, b, c = _instance("a", requests=3, tokens=10), _instance("b", requests=1, tokens=900), _instance("c", requests=2,
                                                                                                      tokens=50)
    req = RoutedRequest(None, 10)
    assert LeastRequests().choose([a, b, c], req) is b
    assert LeastTokens().choose([a, b, c], req) is a
    p2c = PowerOfTwo()
    assert all(p2c.choose([a, b, c], req) is not a for _ in range(50))  # a has the most requests: never chosen
    rr = RoundRobin()
    assert [rr.choose([a, b, c], req).url for _ in range(4)] == ["a", "b", "c", "a"]


def test_cache_aware_trades_the_cached_prefix_against_load() -> None:
    """Without KV events: the prefix goes where this policy sent it. Cost in blocks of 4: prompt tokens to compute
    + tokens queued for prefill there, + a tenth of the prompt tokens decoding there."""
    policy = CacheAware()
    a, b = _instance("a"), _instance("b")
    shared = list(range(40))  # 10 blocks of 4
    first = policy.choose([a, b], RoutedRequest(shared + [1000], 41))
    other = b if first is a else a
    assert policy.choose([a, b], RoutedRequest(shared + [2000] * 3, 43)) is first  # 3 tokens to compute vs 43
    first.served = 2  # as the registry counts it
    assert policy.choose([a, b], RoutedRequest(list(range(500, 540)), 40)) is other  # no match: fewer served wins
    first.in_flight_requests, first.in_flight_tokens = 1, 300  # a long stream decoding there: 1 + 30 < 41
    assert policy.choose([a, b], RoutedRequest(shared + [6], 41)) is first
    first.in_flight_tokens = first.in_flight_prefill_tokens = 36  # a prompt waiting there: 1 + 36 < 41
    assert policy.choose([a, b], RoutedRequest(shared + [8], 41)) is first
    first.in_flight_tokens = first.in_flight_prefill_tokens = 40  # 1 + 40 = 41: a tie, broken by requests
    assert policy.choose([a, b], RoutedRequest(shared + [7], 41)) is other
    dynamo, c, d = CacheAware(decode_weight=1.0), _instance("c"), _instance("d")  # decoding streams weigh fully
    assert dynamo.choose([c, d], RoutedRequest(shared + [1], 41)) is c
    c.served, c.in_flight_requests, c.in_flight_tokens = 1, 1, 300
    assert dynamo.choose([c, d], RoutedRequest(shared + [6], 41)) is d  # 1 + 300 > 41


def test_cache_aware_reads_what_instances_publish_over_what_it_sent() -> None:
    """With KV events: an instance holds what its events say, whoever sent it there, until they say it is gone."""
    from pdserve.kv_events.events import BlockRemoved, BlockStored
    from pdserve.kv_events.index import KVIndex

    index = KVIndex()
    policy = CacheAware(kv_index=index)
    a, b = _instance("a"), _instance("b")
    index.set_sources("a", ["a#0"])
    index.set_sources("b", ["b#0"])
    prompt = RoutedRequest(list(range(40)) + [1], 41)
    hashes = prompt.block_hashes(4)
    index.apply("b#0", [BlockStored(hashes[:6], None, [], 4, None, "GPU"), BlockStored(hashes[6:], None, [], 4,
                                                                                        None, "CPU")])
    assert policy.choose([a, b], prompt) is b and prompt.predicted_cached_tokens == 40  # device run, then host tier
    for _ in range(3):
        assert policy.choose([a, b], RoutedRequest(list(range(40)) + [2], 41)) is b  # sent there: still b
        b.served += 1
    index.apply("b#0", [BlockRemoved(hashes[:1], "GPU")])  # its first block was evicted: nothing matches
    assert policy.choose([a, b], RoutedRequest(list(range(40)) + [3], 41)) is a  # b served more
    assert policy.cache.cached_blocks("a", hashes) == 0  # sending there taught it nothing: a publishes events


def test_pairs_need_equal_compatibility_keys_and_ipc_needs_one_host() -> None:
    p = _instance("p", transports=["ipc", "tcp"], host_id="host-a", compatibility_key=KEY)
    d_same = _instance("d1", "decode", transports=["ipc", "tcp"], host_id="host-a", compatibility_key=KEY)
    d_other = _instance("d2", "decode", transports=["ipc", "tcp"], host_id="host-b", compatibility_key=KEY)
    d_ipc_only = _instance("d3", "decode", transports=["ipc"], host_id="host-b", compatibility_key=KEY)
    d_model = _instance("d4", "decode", transports=["tcp"], host_id="host-a", compatibility_key=KEY + "x")
    assert pair_transport(p, d_same) == "ipc"
    assert pair_transport(p, d_other) == "tcp"  # same address text or not, another host id means tcp
    assert not compatible(p, d_ipc_only) and not compatible(p, d_model)
    registry = Registry()
    for i in (p, d_ipc_only, d_model):
        registry._instances[i.url] = i
    selector = Selector(registry, LeastTokens(), LeastRequests())
    assert selector.pick(RoutedRequest(None, 1)) is None and "compatible" in selector.why_not()
    registry._instances[d_other.url] = d_other
    route = selector.pick(RoutedRequest(None, 1))
    assert route.decode is d_other and route.transport == "tcp"


def test_prefill_and_decode_of_different_kv_dtypes_are_refused_naming_both(caplog) -> None:
    from pdserve.kv.layout import KVLayout

    def key(dtype: str) -> str:
        return KVLayout(0, 30, 16, 3, 64, dtype).compatibility_key("SmolLM2")

    pair = {"transports": ["tcp"], "pid": None}
    registry = Registry()
    registry.register(Registration(role="prefill", url="http://127.0.0.1:1", compatibility_key=key("fp8_e4m3"),
                                   **pair))
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        registry.register(Registration(role="decode", url="http://127.0.0.1:2", compatibility_key=key("bfloat16"),
                                       **pair))
    assert "cannot be paired" in caplog.text and "dtype=fp8_e4m3" in caplog.text and "dtype=bfloat16" in caplog.text
    for instance in registry.all():
        instance.healthy = True
    selector = Selector(registry, LeastTokens(), LeastRequests())
    assert selector.pick(RoutedRequest(None, 1)) is None
    assert "dtype=fp8_e4m3" in selector.why_not() and "dtype=bfloat16" in selector.why_not()


def test_a_lora_request_goes_only_to_instances_serving_its_adapter() -> None:
    """P1 and D1 serve adapter "sql", P2 and D2 do not, the mixed one serves "chat"; the least loaded would win."""
    pair = {"transports": ["tcp"], "compatibility_key": KEY}
    p1 = _instance("p1", requests=5, loras=["sql"], **pair)
    p2 = _instance("p2", **pair)
    d1 = _instance("d1", "decode", requests=5, loras=["sql"], **pair)
    d2 = _instance("d2", "decode", **pair)
    m = _instance("m", "mixed", requests=9, loras=["chat"])
    registry = Registry()
    for i in (p1, p2, d1, d2, m):
        registry._instances[i.url] = i
    selector = Selector(registry, LeastTokens(), LeastRequests())
    sql = RoutedRequest([1, 2, 3, 4, 5], 5, lora="sql")
    route = selector.pick(sql)
    assert (route.first, route.decode) == (p1, d1)
    assert selector.pick(RoutedRequest(None, 1, lora="chat")).first is m
    assert selector.pick(RoutedRequest(None, 1)).first is p2  # the base: any instance
    assert selector.serves_lora("sql") and not selector.serves_lora("base-model")
    assert selector.pick(sql, exclude={"d1"}) is None and not selector.can_route(sql, {"d1"})
    # an adapter's prompt hashes apart from the same tokens under the base (the engine's prefix-cache keys)
    assert sql.block_hashes(4)[0] != RoutedRequest([1, 2, 3, 4, 5], 5).block_hashes(4)[0]


def test_a_lora_request_prefers_an_instance_whose_slots_hold_its_adapter_unless_it_is_much_busier() -> None:
    from pdserve.admission.load import LoadReport
    from pdserve.router.selector import WARM_SLACK

    def report(loras: list[str]) -> LoadReport:
        return LoadReport(0.0, [], 0, 0, 64, 0.0, 0.0, 0.0, 0.0, loras=loras)

    warm = _instance("warm", "mixed", requests=3, loras=["sql", "chat"])
    cold = _instance("cold", "mixed", requests=0, loras=["sql", "chat"])
    warm.load, cold.load = report(["sql"]), report(["chat"])
    registry = Registry()
    for i in (warm, cold):
        registry._instances[i.url] = i
    selector = Selector(registry, LeastRequests(), LeastRequests())
    assert selector.pick(RoutedRequest(None, 1, lora="sql")).first is warm  # though the busier
    assert selector.pick(RoutedRequest(None, 1, lora="chat")).first is cold
    assert selector.pick(RoutedRequest(None, 1)).first is cold  # the base: least requests
    warm.in_flight_requests = WARM_SLACK + 1
    assert selector.pick(RoutedRequest(None, 1, lora="sql")).first is cold


def _conditional_pair(decider: PrefillDecider) -> tuple[Instance, Instance, Selector, list]:
    """A prefill and a decode instance, and a selector that records its decisions."""
    p = _instance("p", transports=["tcp"], compatibility_key=KEY)
    d = _instance("d", "decode", transports=["tcp"], compatibility_key=KEY)
    registry = Registry()
    for i in (p, d):
        registry._instances[i.url] = i
    seen: list = []
    return p, d, Selector(registry, LeastTokens(), LeastRequests(), decider=decider, on_decision=seen.append), seen


def test_conditional_pd_decides_by_uncached_length_and_prefill_backlog() -> None:
    p, d, selector, seen = _conditional_pair(PrefillDecider(max_local_prefill_length=8, max_prefill_queue_tokens=100))
    route = selector.pick(RoutedRequest(list(range(8)), 8))
    assert route.first is d and route.decode is None  # D alone, no pair
    long = list(range(100, 140))
    assert selector.pick(RoutedRequest(long, 40)).decode is d  # P then D
    assert selector.pick(RoutedRequest(long + [7] * 6, 46)).first is d  # 40 tokens D holds: 6 to compute
    p.in_flight_tokens = 100  # P backed up: even a long new prompt stays on D
    assert selector.pick(RoutedRequest(list(range(300, 340)), 40)).first is d
    assert [(x.local, x.reason, x.uncached_tokens) for x in seen] == [
        (True, "short", 8), (False, "long", 40), (True, "cached", 6), (True, "prefill_busy", 40)]


def test_conditional_pd_leaves_long_prompts_to_an_idle_decode_instance_when_asked() -> None:
    decider = PrefillDecider(max_local_prefill_length=8, local_prefill_decode_requests=1)
    _, d, selector, seen = _conditional_pair(decider)
    d.in_flight_requests = 1
    assert selector.pick(RoutedRequest(list(range(100, 140)), 40)).first is d  # D has one request: it computes
    d.in_flight_requests = 2
    assert selector.pick(RoutedRequest(list(range(200, 240)), 40)).decode is d  # two: P computes, D decodes
    assert [(x.local, x.reason) for x in seen] == [(True, "decode_idle"), (False, "long")]


def test_conditional_pd_leaves_the_prompt_to_p_where_d_would_be_late() -> None:
    """With a TTFT objective, a decode instance whose own computing of the prompt would miss it does not take the
    prompt, whatever the decider's rule says (here: D idle); the prefill instance computes it, and the request
    is admitted. Once D's queue is short again, D computes it itself."""
    from prometheus_client import CollectorRegistry

    from pdserve.admission.load import LoadReport
    from pdserve.admission.metrics import AdmissionMetrics
    from pdserve.admission.predictor import SLO
    from pdserve.router.admission import Admitted, RouterAdmission

    p, d, selector, seen = _conditional_pair(PrefillDecider(max_local_prefill_length=8,
                                                            local_prefill_decode_requests=1))

    def report(queued_tokens: int) -> LoadReport:
        return LoadReport(time.time(), [(0, queued_tokens)] if queued_tokens else [], 0, 0, 64, prefill_rate=1000.0,
                          step_time=0.02, decode_cost=0.001, next_finish=0.0)

    admission = RouterAdmission(SLO(ttft=2.0), None, AdmissionMetrics(CollectorRegistry(), "t"), selector.registry,
                                selector, None)
    p.load, d.load = report(0), report(3000)  # D has 3 s of prompts of its own queued
    late = RoutedRequest(list(range(100, 140)), 40)
    assert isinstance(admission.admit({}, {}, late, time.monotonic()), Admitted)
    assert late.slow_local_prefill == {d.url}
    route = selector.pick(late)
    assert route.first is p and route.decode is d
    d.load = report(0)
    quick = RoutedRequest(list(range(200, 240)), 40)
    assert isinstance(admission.admit({}, {}, quick, time.monotonic()), Admitted)
    assert selector.pick(quick).first is d
    assert [(x.local, x.reason) for x in seen] == [(False, "slow_locally"), (True, "decode_idle")]


def test_a_burst_on_one_prefix_is_judged_as_one_prefix_and_many_tails() -> None:
    """With a TTFT objective, each request of a burst that shares a long prefix counts the prefix once: the
    instance computes it for the first and finds it cached for the others. Counted whole, the third of these was
    refused (three 410-token prompts at 1,000 tokens/s miss 1 s); a prompt of its own still counts whole."""
    from prometheus_client import CollectorRegistry

    from pdserve.admission.load import LoadReport
    from pdserve.admission.metrics import AdmissionMetrics
    from pdserve.admission.predictor import SLO
    from pdserve.router.admission import Admitted, RouterAdmission

    m = _instance("m", "mixed")
    registry = Registry()
    registry._instances[m.url] = m
    selector = Selector(registry, LeastTokens(), LeastRequests())
    m.load = LoadReport(time.time(), [], 0, 0, 64, prefill_rate=1000.0, step_time=0.02, decode_cost=0.001,
                        next_finish=0.0, acked=0)
    admission = RouterAdmission(SLO(ttft=1.0), None, AdmissionMetrics(CollectorRegistry(), "t"), registry, selector,
                                None)
    prefix = list(range(1000, 1400))
    for i in range(8):
        request = RoutedRequest(prefix + list(range(i * 10, i * 10 + 10)), 410)
        verdict = admission.admit({}, {}, request, time.monotonic())
        assert isinstance(verdict, Admitted), (i, verdict)
        admission.routed(selector.pick(request), request)
    assert m.sent.since(0.0) == (410 + 7 * 10, 8)  # what the instance will compute, not 8 x 410
    own = RoutedRequest(list(range(5000, 5700)), 700)
    assert not isinstance(admission.admit({}, {}, own, time.monotonic()), Admitted)  # 480 queued + 700 > 1 s


def _fitted_report(queued_tokens: int = 0) -> LoadReport:
    """A calibrated instance's report (1,000 prompt tokens/s, steps of at most 512 of them: 10 ms + 1 ms a
    stream + 1 ms a token), nothing in flight but `queued_tokens` of prompts."""
    return LoadReport(time.time(), [(0, queued_tokens)] if queued_tokens else [], 0, 0, 64, prefill_rate=1000.0,
                      step_time=0.02, decode_cost=0.001, next_finish=0.0, step_tokens=512, step_base=0.01,
                      prompt_token_cost=0.001, quiet_step_base=0.01, quiet_decode_cost=0.001,
                      quiet_prefill_rate=1000.0)


def _admission(selector: Selector, ttft: float):  # noqa: ANN202
    from prometheus_client import CollectorRegistry

    from pdserve.admission.metrics import AdmissionMetrics
    from pdserve.admission.predictor import SLO
    from pdserve.router.admission import RouterAdmission

    return RouterAdmission(SLO(ttft=ttft), None, AdmissionMetrics(CollectorRegistry(), "t"), selector.registry,
                           selector, None)


def test_a_burst_computed_on_the_decode_instance_counts_the_streams_sent_there() -> None:
    """Conditional PD sends short prompts to D to compute. A burst of them arrives while D's report still shows it
    idle: what the router sent since counts, so once D's queue would make a first token late, the prompts go to
    P instead. (Counted from the report alone, D stayed within its floor and took all 40: the first burst's
    second wave then waited a whole extra step.)"""
    from pdserve.router.admission import Admitted

    p, d, selector, seen = _conditional_pair(PrefillDecider(max_local_prefill_length=256))
    p.load, d.load = _fitted_report(), _fitted_report()
    admission = _admission(selector, ttft=1.0)
    refused = 0
    for i in range(40):
        request = RoutedRequest(list(range(i * 100, i * 100 + 100)), 100)
        if isinstance(admission.admit({}, {}, request, time.monotonic()), Admitted):
            admission.routed(selector.pick(request), request)
        else:
            refused += 1
    local = [x.local for x in seen]
    assert local[:9] == [True] * 9, local  # 900 tokens at 1,000 a second: within 1 s
    assert local[9:] and not any(local[9:]) and {x.reason for x in seen[9:]} == {"slow_locally"}
    assert refused == 40 - len(seen) > 0  # then P's queue is full too: refused, not sent to D


def test_a_prompt_computed_by_prefill_counts_the_decode_instances_step_before_its_first_token() -> None:
    """The first token of a PD request comes from D's next step; while D computes prompts of its own, that step is
    long, and a prompt P would compute in time is refused when D's step makes it late. Where D has nothing
    queued, the same prompt is admitted; where no prefill instance can take a prompt and D would be late with it,
    it is refused rather than sent to D."""
    from pdserve.router.admission import Admitted

    p, d, selector, _ = _conditional_pair(PrefillDecider(max_local_prefill_length=8))
    admission = _admission(selector, ttft=0.5)
    p.load, d.load = _fitted_report(), _fitted_report(queued_tokens=2000)  # D's steps carry 512 tokens: ~0.5 s
    prompt = list(range(1000, 1300))  # P alone: ~0.3 s (and above the floor of prompts P serves in half the SLO)
    verdict = admission.admit({}, {}, RoutedRequest(prompt, 300), time.monotonic())
    assert not isinstance(verdict, Admitted) and verdict.reason == "ttft_slo"
    d.load = _fitted_report()
    assert isinstance(admission.admit({}, {}, RoutedRequest(prompt, 300), time.monotonic()), Admitted)
    p.healthy, d.load = False, _fitted_report(queued_tokens=2000)  # P gone; D's own queue is 2 s of prompts
    verdict = admission.admit({}, {}, RoutedRequest(prompt, 300), time.monotonic())
    assert not isinstance(verdict, Admitted) and verdict.reason == "ttft_slo"


def test_routes_follow_roles_changed_in_place() -> None:
    """A switchable mixed instance is a prefill instance's partner; with no prefill instance, decode instances take
    whole requests; a draining instance gets nothing new; a role change keeps the instance in the pool."""
    pair = {"transports": ["tcp"], "compatibility_key": KEY}
    p = _instance("p", tokens=100, **pair)
    m = _instance("m", "mixed", pd_sides=["decode"], **pair)
    registry = Registry()
    for i in (p, m):
        registry._instances[i.url] = i
    selector = Selector(registry, LeastTokens(), LeastRequests())
    m.in_flight_tokens = 500  # the prefill instance is the less busy: it computes, the mixed one decodes
    route = selector.pick(RoutedRequest(None, 100))
    assert (route.first, route.decode, route.transport) == (p, m, "tcp")
    m.in_flight_tokens = 0
    assert selector.pick(RoutedRequest(None, 100)) == Route(m)  # or the mixed one takes it whole
    d = _instance("d", "decode", **pair)
    registry._instances = {"m": m, "d": d}
    m.in_flight_requests = 3
    assert selector.pick(RoutedRequest(None, 1)) == Route(d)  # no prefill instance: D computes it whole
    registry.register(Registration(role="mixed", url="m", pid=None, draining=True, **pair))
    d.in_flight_requests = 9
    assert m.healthy and selector.pick(RoutedRequest(None, 1)) == Route(d)  # m drains: nothing new goes to it
    registry.register(Registration(role="prefill", url="m", pid=None, **pair))
    assert m.healthy and m.role == "prefill", "a role changed in place left the pool"
    route = selector.pick(RoutedRequest(None, 1))
    assert (route.first, route.decode) == (m, d)


def test_health_thresholds_and_lost_requests() -> None:
    registry = Registry(fail_threshold=3, success_threshold=2)
    instance, probe = registry.register(Registration(role="decode", url="http://d", pid=1))  # not contacted
    assert probe and not instance.healthy
    registry.probe_succeeded(instance)  # a newcomer joins on its first good probe
    assert instance.healthy
    lost: list[str] = []
    with registry.track(instance, 10, lost.append):
        assert instance.in_flight_requests == 1 and instance.in_flight_tokens == 10
        registry.probe_failed(instance, "503")
        registry.probe_failed(instance, "503")
        assert instance.healthy and not lost
        registry.probe_failed(instance, "503")
        assert not instance.healthy and lost == ["503"]  # the request in flight hears at once
    assert instance.in_flight_requests == 0
    registry.probe_succeeded(instance)
    assert not instance.healthy  # coming back takes two
    registry.probe_succeeded(instance)
    assert instance.healthy
    again, probe = registry.register(Registration(role="decode", url="http://d", pid=2))  # restarted; not contacted
    assert probe and again is not instance and not again.healthy
    assert (instance.restarts, again.restarts) == (0, 1) and again.as_dict()["restarts"] == 1
    registry.expiry = 0
    registry.expire()  # forgotten (no heartbeat) while it restarts: the count survives
    assert not registry.all()
    third, _ = registry.register(Registration(role="decode", url="http://d", pid=3))  # not contacted
    assert third.restarts == 2


# ---- a router process with stand-in instances --------------------------------------------------

@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = Router(tmp_path_factory.mktemp("router"), "--cluster-secret", SECRET, "--api-key", API_KEY,
               "--health-interval", "0.2", "--max-request-bytes", "100000", "--tokenizer", "none")
    yield r
    r.stop()


@pytest.fixture
def stubs(router: Router) -> Iterator[list[StubInstance]]:
    out = [StubInstance("alpha"), StubInstance("beta")]
    for stub in out:
        assert register(router.url, stub.registration(), SECRET.encode()).status_code == 200
    wait_for(lambda: {s.url for s in out} <= router.healthy_urls(), 10, "the stand-ins did not join the pool")
    yield out
    for stub in out:
        register(router.url, {"url": stub.url}, SECRET.encode(), path="/unregister")
        stub.close()


def _client(router: Router, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.mark.e2e
def test_registration_needs_the_cluster_secret(router: Router) -> None:
    stranger = StubInstance("stranger")
    try:
        unsigned = httpx.post(f"{router.url}/register", json=stranger.registration())
        forged = register(router.url, stranger.registration(), b"guessed")
        for r in (unsigned, forged):
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert stranger.url not in {i["url"] for i in router.registered()}
        assert "refused /register" in router.log()
        body = json.dumps(stranger.registration()).encode()
        signed = {"Content-Type": "application/json", SIGNATURE_HEADER: sign_body(SECRET.encode(), "/register", body)}
        assert httpx.post(f"{router.url}/register", content=body, headers=signed).status_code == 200
        wait_for(lambda: stranger.url in router.healthy_urls(), 10, "a member's registration was not taken")
        replayed = httpx.post(f"{router.url}/register", content=body, headers=signed)
        assert replayed.status_code == 403 and "replayed" in replayed.json()["error"]["message"]
        moved = httpx.post(f"{router.url}/unregister", content=body, headers=signed)  # a heartbeat as a leave
        assert moved.status_code == 403 and stranger.url in router.healthy_urls()
    finally:
        register(router.url, {"url": stranger.url}, SECRET.encode(), path="/unregister")
        stranger.close()


@pytest.mark.e2e
def test_an_instance_that_hangs_up_mid_registration_is_logged_not_a_traceback(router: Router) -> None:
    """A stopping instance's heartbeat cut off after its headers: one line in the log, the router serves on (the
    module's teardown finds no traceback in its log)."""
    import socket

    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n{\"url\": ")
    wait_for(lambda: "hung up before its body arrived" in router.log(), 10, "the cut-off registration was not logged")
    assert "Traceback" not in router.log()
    assert httpx.get(f"{router.url}/instances", timeout=5).status_code == 200


@pytest.mark.e2e
def test_clients_need_the_api_key(router: Router, stubs: list[StubInstance]) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(router, "sk-wrong").completions.create(model="stub", prompt="hi", max_tokens=2)
    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert sum(len(s.requests) for s in stubs) == 0  # nothing reached an instance
    out = _client(router).completions.create(model="stub", prompt="hi", max_tokens=2)
    assert out.choices[0].text in ("alpha", "beta")
    big = httpx.post(f"{router.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"prompt": "x" * 200_000})
    assert big.status_code == 413 and "max-request-bytes" in big.json()["error"]["message"]


@pytest.mark.e2e
def test_least_requests_spreads_and_health_checks_move_traffic(router: Router, stubs: list[StubInstance]) -> None:
    alpha, beta = stubs
    client = _client(router)
    texts = [client.completions.create(model="stub", prompt="hi", max_tokens=2).choices[0].text for _ in range(6)]
    assert texts.count("alpha") == texts.count("beta") == 3  # idle instances take turns
    alpha.health_status = 503
    wait_for(lambda: alpha.url not in router.healthy_urls(), 10, "a failing instance did not leave the pool")
    before = len(alpha.requests)
    stream = client.completions.create(model="stub", prompt="hi", max_tokens=2, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "beta!"
    assert [client.completions.create(model="stub", prompt="hi").choices[0].text for _ in range(3)] == ["beta"] * 3
    assert len(alpha.requests) == before
    alpha.health_status = 200
    wait_for(lambda: alpha.url in router.healthy_urls(), 10, "a recovered instance did not come back")
    counts = httpx.get(f"{router.url}/registered_number").json()
    assert counts["healthy"]["mixed"] >= 2


@pytest.mark.e2e
def test_static_instance_list_and_a_mixed_instance_serving_beside_an_incomplete_pair(tmp_path: Path) -> None:
    """Mixed instances are routes like pairs: with a prefill instance and no decode one, the mixed one serves."""
    mixed, prefill = StubInstance("mixed"), StubInstance("prefill")
    listing = tmp_path / "instances.yaml"
    listing.write_text(yaml.safe_dump({"instances": [mixed.registration(), prefill.registration("prefill")]}))
    router = Router(tmp_path / "router", "--instances", str(listing), "--tokenizer", "none", "--health-interval", "0.2")
    try:
        wait_for(lambda: len(router.healthy_urls()) == 2, 10, "the static instances were not probed")
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "mixed"
    finally:
        router.stop()
        mixed.close()
        prefill.close()


@pytest.mark.e2e
def test_a_stream_cut_mid_answer_resumes_on_another_instance_and_limit_0_ends_it(tmp_path: Path) -> None:
    alpha, beta = StubInstance("alpha"), StubInstance("beta")
    story = ["Once", " upon", " a", " time"]
    for stub in (alpha, beta):
        stub.story, stub.cut_after = story, 2  # whichever answers first dies after two words
    listing = tmp_path / "instances.yaml"
    listing.write_text(yaml.safe_dump({"instances": [alpha.registration(), beta.registration()]}))
    routers = []
    try:
        for limit in ("3", "0"):
            routers.append(Router(tmp_path / f"router-{limit}", "--instances", str(listing), "--tokenizer", "none",
                                  "--health-interval", "0.2", "--migration-limit", limit))
            wait_for(lambda r=routers[-1]: len(r.healthy_urls()) == 2, 10, "the static instances were not probed")
        resuming, failing = routers
        client = openai.OpenAI(base_url=f"{resuming.url}/v1", api_key="x", max_retries=0, timeout=30)
        chunks = list(client.completions.create(model="stub", prompt="hi", max_tokens=4, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == "Once upon a time"  # no word lost or repeated
        first, second = sorted((alpha, beta), key=lambda s: len(s.requests[0]["migration"].get("token_ids", [])))
        assert first.requests[0]["migration"] == {}  # asked to name its tokens
        resumed = second.requests[0]["migration"]
        assert resumed["token_ids"] == [100, 101] and resumed["id"] == f"cmpl-{first.name}"
        assert {c.id for c in chunks} == {f"cmpl-{first.name}"}  # one stream, one id
        assert chunks[-1].choices[0].finish_reason == "length"
        text = httpx.get(f"{resuming.url}/metrics").text
        assert 'pdserve_router_migrations_total{outcome="resumed"} 1.0' in text

        wait_for(lambda: len(failing.healthy_urls()) == 2, 10, "the cut instance did not come back")
        for stub in (alpha, beta):
            stub.requests.clear()
        client = openai.OpenAI(base_url=f"{failing.url}/v1", api_key="x", max_retries=0, timeout=30)
        texts = []
        with pytest.raises(openai.APIError, match="failed mid-answer"):
            for c in client.completions.create(model="stub", prompt="hi", max_tokens=4, stream=True):
                texts.append(c.choices[0].text)
        assert texts == ["Once", " upon"]
        assert [len(s.requests) for s in (alpha, beta)] in ([1, 0], [0, 1])  # not sent again
        assert "migration" not in (alpha.requests or beta.requests)[0]
    finally:
        for r in routers:
            r.stop()
        alpha.close()
        beta.close()


@pytest.mark.e2e
def test_a_stream_that_ends_inside_an_event_resumes_and_the_client_never_sees_half_an_event(tmp_path: Path) -> None:
    """The instance's answer ends cleanly (the HTTP body is complete) but inside an SSE event: that is a failure
    mid-answer, not an event to relay (the client would get a line it cannot parse)."""
    alpha, beta = StubInstance("alpha"), StubInstance("beta")
    for stub in (alpha, beta):
        stub.story, stub.cut_after, stub.cut_mid_event = ["Once", " upon", " a", " time"], 2, True
    listing = tmp_path / "instances.yaml"
    listing.write_text(yaml.safe_dump({"instances": [alpha.registration(), beta.registration()]}))
    router = Router(tmp_path / "router", "--instances", str(listing), "--tokenizer", "none", "--health-interval", "0.2")
    try:
        wait_for(lambda: len(router.healthy_urls()) == 2, 10, "the static instances were not probed")
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=30)
        chunks = list(client.completions.create(model="stub", prompt="hi", max_tokens=4, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == "Once upon a time"
        assert sorted(len(s.requests) for s in (alpha, beta)) == [1, 1]  # resumed on the other one
    finally:
        router.stop()
        alpha.close()
        beta.close()


@pytest.mark.e2e
def test_a_cut_stream_with_no_other_route_waits_for_the_instance_to_come_back(router: Router) -> None:
    """1P1D or one mixed instance: the stream resumes on the restarted process (a new pid), not the dead one."""
    alone = StubInstance("alone")
    alone.story, alone.cut_after = ["Once", " upon", " a", " time"], 2
    try:
        assert register(router.url, alone.registration(pid=1), SECRET.encode()).status_code == 200
        wait_for(lambda: alone.url in router.healthy_urls(), 10, "the stand-in did not join the pool")
        restarted = threading.Event()

        def die_and_restart() -> None:
            wait_for(lambda: len(alone.requests) == 1, 10, "no request came")
            time.sleep(0.5)  # the cut (0.3 s after two words)
            alone.health_status, alone.cut_after = 503, None  # down ...
            time.sleep(1.0)
            alone.health_status = 200  # ... and back, a new process
            register(router.url, alone.registration(pid=2), SECRET.encode())
            restarted.set()

        threading.Thread(target=die_and_restart, daemon=True).start()
        chunks = list(_client(router).completions.create(model="stub", prompt="hi", max_tokens=4, stream=True))
        assert restarted.is_set()
        assert "".join(c.choices[0].text for c in chunks) == "Once upon a time"
        assert alone.requests[1]["migration"]["token_ids"] == [100, 101]
    finally:
        register(router.url, {"url": alone.url}, SECRET.encode(), path="/unregister")
        alone.close()


@pytest.mark.e2e
def test_a_new_request_waits_while_the_only_route_comes_back(router: Router) -> None:
    """The pool served a moment ago and its only instance left it (being restarted, or placed again on another
    node): a request that arrives meanwhile is answered once the instance is back, not refused with a 503."""
    alone = StubInstance("alone")
    try:
        assert register(router.url, alone.registration(pid=1), SECRET.encode()).status_code == 200
        wait_for(lambda: alone.url in router.healthy_urls(), 10, "the stand-in did not join the pool")
        assert _client(router).completions.create(model="stub", prompt="hi").choices[0].text == "alone"
        alone.health_status = 503
        wait_for(lambda: alone.url not in router.healthy_urls(), 10, "the stand-in did not leave the pool")
        waited = []

        def restart() -> None:
            time.sleep(1.5)
            alone.health_status = 200
            register(router.url, alone.registration(pid=2), SECRET.encode())

        threading.Thread(target=restart, daemon=True).start()
        start = time.monotonic()
        answer = _client(router).completions.create(model="stub", prompt="hi")
        waited.append(time.monotonic() - start)
        assert answer.choices[0].text == "alone" and waited[0] >= 1.0, waited
    finally:
        register(router.url, {"url": alone.url}, SECRET.encode(), path="/unregister")
        alone.close()
