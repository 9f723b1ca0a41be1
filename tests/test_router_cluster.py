"""A 2P2D deployment through the router, on four loopback addresses standing in for two hosts:
host-a has p0 and d0, host-b has p1 and d1, so a pair on one host talks ipc and across hosts tcp.
Checked against a mixed instance: spreading by load, prefix affinity, forged control messages, and
instances killed under load (a D or its worker mid-stream: the stream is resumed on the other pair;
a P after its first token; a P with requests queued on it).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import openai
import psutil
import pytest
import yaml
import zmq

from tests.greedy import assert_same_greedy_completion, assert_same_greedy_completions
from tests.servers import Router, Server, metrics, segments, stop_all, wait_for

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

MODEL = "tiny"  # conftest.tiny_model: protocol and failover, in fp32 so routes agree exactly
SECRET = "cluster-test-secret"
COMMON = ["--max-model-len", "1024", "--max-num-batched-tokens", "128", "--max-num-seqs", "32",
          "--num-gpu-blocks-override", "200", "--pd-transfer-timeout", "10"]  # abandoned blocks back in 11 s
INSTANCES = {  # name: (role, address, host id)
    "p0": ("prefill", "127.0.0.2", "host-a"), "p1": ("prefill", "127.0.0.3", "host-b"),
    "d0": ("decode", "127.0.0.4", "host-a"), "d1": ("decode", "127.0.0.5", "host-b"),
}
SHORTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are",
          "def fibonacci(n):", "Once upon a time, in a small village,", "The largest planet in the solar system is",
          "To make a cup of tea, first", "1, 2, 3, 4, 5,", "The opposite of hot is", "Monday, Tuesday,"]
STORY = ("A lighthouse keeper on a northern island writes down the ships that pass, the weather, and the colour "
         "of the sea each morning, and in winter he reads the old logs of the keepers before him. ")


# d1 speculates (n-gram): answers that move to or from it mid-stream still read as one unbroken answer
SPECULATIVE = ["--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}']


def _instance_flags(name: str, router: Router, model: list[str]) -> list[str]:
    role, _, host_id = INSTANCES[name]
    return [*model, "--splitwise-role", role, "--host-id", host_id, "--cache-transfer-protocol", "ipc,tcp",
            "--router", router.url, "--cluster-secret", SECRET, *COMMON, *(SPECULATIVE if name == "d1" else [])]


def _start(tmp: Path, name: str, router: Router, model: list[str], wait: bool, port: int | None = None,
           metrics_port: int | None = None, workdir: str | None = None) -> Server:
    return Server(tmp / (workdir or name), *_instance_flags(name, router, model), host=INSTANCES[name][1], wait=wait,
                  port=port, metrics_port=metrics_port, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: list[str]) -> Iterator[dict]:
    before = segments()
    tmp = tmp_path_factory.mktemp("cluster")
    router = Router(tmp / "router", "--cluster-secret", SECRET, "--health-interval", "0.5",
                    "--health-failure-threshold", "2")
    servers = {name: _start(tmp, name, router, tiny_model, wait=False) for name in INSTANCES}
    servers["mixed"] = Server(tmp / "mixed", *tiny_model, *COMMON, wait=False)
    state = {"router": router, "tmp": tmp, "model": tiny_model, **servers}
    try:
        for s in servers.values():
            s.wait_ready(300)
        router.wait_pairs(4, 60)
        yield state
    finally:  # the instances a test killed are gone already
        stop_all([state[n] for n in [*INSTANCES, "mixed"] if state[n].proc.poll() is None] + [router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)


def _complete(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 8) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2)


def _served(router: Router) -> dict[str, int]:
    return {i["url"]: i["served"] for i in router.registered()}


def _metric(server: Server, name: str) -> float:
    return metrics(server.metrics_port, server.host).get(name, 0.0)


def _blocks_free(cluster: dict, names: list[str], timeout: float) -> None:
    for name in names:
        s = cluster[name]
        wait_for(lambda s=s: _metric(s, "pdserve_kv_cache_free_blocks") == _metric(s, "pdserve_kv_cache_total_blocks"),
                 timeout, f"{name} did not give all its KV blocks back")


def test_2p2d_serves_40_concurrent_requests_on_every_instance_like_mixed(cluster: dict, embedded_tokenizer) -> None:
    tokenizer = embedded_tokenizer
    ids = tokenizer.encode(STORY * 8)
    prompts = [*SHORTS, *(ids[i * 7:i * 7 + 20 + 4 * i] for i in range(30))]
    router = cluster["router"]
    before = _served(router)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: _complete(_client(router.url), p), prompts))
    with ThreadPoolExecutor(len(prompts)) as pool:
        reference = list(pool.map(lambda p: _complete(_client(cluster["mixed"].url), p), prompts))
    assert_same_greedy_completions(outs, reference, min_share=0.8)
    after = _served(router)
    served = {name: after[cluster[name].url] - before.get(cluster[name].url, 0) for name in INSTANCES}
    assert all(n > 0 for n in served.values()), f"an instance got no request: {served}"
    assert sum(served[p] for p in ("p0", "p1")) == len(prompts)
    wait_for(lambda: sum(_transfers_by_protocol(cluster).values()) >= len(prompts), 5,  # metrics refresh: 1 s
             "P did not count a KV transfer per request")
    by_protocol = _transfers_by_protocol(cluster)
    assert by_protocol["ipc"] > 0, by_protocol  # same host: ipc
    if by_protocol["tcp"] == 0:
        # The default policies can pair in lockstep (p0 with d0, p1 with d1) when every request is alike;
        # a router that picks D at random makes cross-host pairs, which must go over tcp.
        _send_through_random_decode_router(cluster, [prompts[i] for i in range(12)])
        assert _transfers_by_protocol(cluster)["tcp"] > 0, _transfers_by_protocol(cluster)  # across hosts: tcp
    _blocks_free(cluster, [*INSTANCES, "mixed"], 20)


def _transfers_by_protocol(cluster: dict) -> dict[str, float]:
    key = 'pdserve_kv_transfers_by_protocol_total{{dp_rank="0",protocol="{}"}}'
    return {proto: sum(_metric(cluster[p], key.format(proto)) for p in ("p0", "p1")) for proto in ("ipc", "tcp")}


def _send_through_random_decode_router(cluster: dict, prompts: list) -> None:
    listing = cluster["tmp"] / "random-static.yaml"
    listing.write_text(yaml.safe_dump({"instances": cluster["router"].registered()}))
    router = Router(cluster["tmp"] / "random-router", "--instances", str(listing), "--decode-policy", "random",
                    "--health-interval", "0.5")
    before = sum(_transfers_by_protocol(cluster).values())
    try:
        wait_for(lambda: len(router.healthy_urls()) == 4, 20, "the static instances did not join")
        for prompt in prompts:  # 12 random D choices: all on P's own host has odds 1 in 4096
            _complete(_client(router.url), prompt)
        # The metrics port refreshes once a second.
        wait_for(lambda: sum(_transfers_by_protocol(cluster).values()) >= before + len(prompts), 5,
                 "the transfers were not counted")
    finally:
        router.stop()


def test_cache_aware_keeps_a_shared_prefix_on_one_prefill_under_concurrency(cluster: dict,
                                                                           embedded_tokenizer) -> None:
    """A second router over the same instances (a static list, KV event endpoints included) with prefix affinity
    on P: the prefix's holder computes 10 tokens of each prompt where the other would compute 330, so six sent at
    once all go there (what they queue for prefill there, 10 tokens each, stays far below 330)."""
    listing = cluster["tmp"] / "static.yaml"
    listing.write_text(yaml.safe_dump({"instances": cluster["router"].registered()}))
    router = Router(cluster["tmp"] / "cache-router", "--instances", str(listing), "--prefill-policy", "cache_aware",
                    "--health-interval", "0.5")
    try:
        wait_for(lambda: len(router.healthy_urls()) == 4, 20, "the static instances did not join")
        tokenizer = embedded_tokenizer
        prefix = tokenizer.encode(STORY * 10)[:320]  # 20 blocks of 16
        hits = {p: _metric(cluster[p], "pdserve_prefix_cache_hits_total") for p in ("p0", "p1")}
        client = _client(router.url)
        for i in range(4):
            client.completions.create(model=MODEL, prompt=prefix + tokenizer.encode(f" Entry {i}:"), max_tokens=2,
                                      temperature=0)

        def gained() -> dict[str, float]:
            return {p: _metric(cluster[p], "pdserve_prefix_cache_hits_total") - hits[p] for p in ("p0", "p1")}

        wait_for(lambda: sum(gained().values()) >= 3 * 320, 5, "the prefix was not served from a prefill cache")
        gained = gained()
        hot = max(gained, key=gained.get)
        cold = "p1" if hot == "p0" else "p0"
        assert gained[hot] >= 3 * 320 and gained[cold] == 0, gained
        before = _served(router)
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: client.completions.create(
                model=MODEL, prompt=prefix + tokenizer.encode(f" Later entry {i}:"), max_tokens=2), range(6)))
        after = _served(router)
        spread = {p: after[cluster[p].url] - before[cluster[p].url] for p in ("p0", "p1")}
        assert spread == {hot: 6, cold: 0}, spread
    finally:
        router.stop()


def test_forged_control_messages_are_refused(cluster: dict) -> None:
    from pdserve.disagg.messages import CacheInfo
    from pdserve.kv.layout import KVLayout
    from pdserve.transport import TcpEndpoint
    from pdserve.utils.cluster_auth import ControlSeal

    p0 = cluster["p0"]
    (info,) = [i for i in cluster["router"].registered() if i["url"] == p0.url]
    layout = KVLayout(200, 30, 16, 3, 64, "float32")
    forged = msgspec.msgpack.encode(CacheInfo("t-forged", 5, "0" * 16, [0], layout, [TcpEndpoint("127.0.0.1", 9)],
                                              30.0, time.time() + 30))
    refused = _metric(p0, "pdserve_pd_refused_control_messages_total")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{info['pd_comm']}")
    for raw in (forged, ControlSeal(b"not-the-secret").seal(forged)):
        sock.send(raw)
    sock.send_multipart([b"two", b"frames"])  # not even our framing: refused, and P must not crash
    wait_for(lambda: _metric(p0, "pdserve_pd_refused_control_messages_total") >= refused + 3, 10,
             "the forged control messages were not refused")
    sock.close()
    ctx.term()
    assert "refused a control message" in p0.log()
    assert _client(cluster["router"].url).completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_a_kv_connection_without_the_secret_is_refused_and_counted(cluster: dict) -> None:
    d0 = cluster["d0"]
    (service,) = d0.children("pdserve.disagg.cache_service")
    (port,) = [c.laddr.port for c in service.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    with socket.create_connection((d0.host, port), timeout=5) as conn:
        conn.recv(64)  # the challenge
        conn.sendall(b"\0" * 32)  # a wrong answer
        assert conn.recv(1) == b""  # hung up on
    wait_for(lambda: _metric(d0, "pdserve_kv_refused_connections_total") == 1, 5, "the refusal was not counted")
    assert "refused a KV connection" in d0.log()
    assert _client(cluster["router"].url).completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_a_client_that_goes_away_stops_the_work_on_the_instances(cluster: dict) -> None:
    """A non-streamed request whose client hangs up: the router cancels it on P and D (which free
    their blocks) instead of generating 400 tokens for nobody. The decode workers are stopped meanwhile, so the
    answer cannot come before the client leaves, however fast the model."""
    router = cluster["router"]
    workers = [w for d in ("d0", "d1") for w in cluster[d].children("pdserve.worker")]
    for w in workers:
        w.suspend()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/completions", timeout=3, json={
                "prompt": "Write a long story about a dragon.", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True})
    finally:
        for w in workers:
            w.resume()
    wait_for(lambda: all(i["in_flight_requests"] == 0 for i in router.registered()), 5,
             "the router kept the abandoned request")
    _blocks_free(cluster, list(INSTANCES), 10)


STORY_PROMPT = "Write a long story about a dragon."
STREAMED = 160  # tokens of the killed streams: the tiny model is still decoding when the kill lands


def _streamed(client: openai.OpenAI, victim_of: Callable[[], None] | None = None, after: int = 3,
              max_tokens: int = STREAMED) -> SimpleNamespace:
    """A greedy stream (logprobs 2, usage) read to its end, `victim_of()` called after `after` chunks;
    joined into the shape of a whole completion, with every chunk's id."""
    stream = client.completions.create(model=MODEL, prompt=STORY_PROMPT, max_tokens=max_tokens, temperature=0,
                                       logprobs=2, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    tokens, tops, ids, usage, finish = [], [], set(), None, None
    for i, chunk in enumerate(stream):
        if i == after and victim_of is not None:
            victim_of()
        ids.add(chunk.id)
        usage = chunk.usage or usage
        if chunk.choices:
            tokens += chunk.choices[0].logprobs.tokens
            tops += chunk.choices[0].logprobs.top_logprobs
            finish = chunk.choices[0].finish_reason or finish
    logprobs = SimpleNamespace(tokens=tokens, top_logprobs=tops)
    return SimpleNamespace(choices=[SimpleNamespace(logprobs=logprobs, finish_reason=finish)], ids=ids, usage=usage)


def _reference(cluster: dict, max_tokens: int = STREAMED) -> openai.types.Completion:
    return _client(cluster["mixed"].url).completions.create(
        model=MODEL, prompt=STORY_PROMPT, max_tokens=max_tokens, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True})


def _busy_decode(cluster: dict) -> str:
    (busy,) = [i["url"] for i in cluster["router"].registered() if i["role"] == "decode" and i["in_flight_requests"]]
    return next(n for n in ("d0", "d1") if cluster[n].url == busy)


def _restart(cluster: dict, name: str, old: Server) -> None:
    """The same address and ports again: a new process, so it joins on its first good probe."""
    router = cluster["router"]
    wait_for(lambda: old.url not in router.healthy_urls(), 5, f"the router kept a dead {name}")
    old.wait_gone(20)
    cluster[name] = _start(cluster["tmp"], name, router, cluster["model"], wait=True, port=old.port,
                           metrics_port=old.metrics_port,
                           workdir=f"{name}-restarted-{time.monotonic_ns()}")
    wait_for(lambda: old.url in router.healthy_urls(), 20, f"the restarted {name} did not rejoin")


@pytest.mark.parametrize("what", ["server", "worker"])
def test_decode_killed_mid_stream_the_stream_goes_on_elsewhere_as_if_unbroken(cluster: dict, what: str) -> None:
    router = cluster["router"]
    killed: list[str] = []

    def kill_the_busy_decode() -> None:
        killed.append(_busy_decode(cluster))
        server = cluster[killed[0]]
        (server if what == "server" else server.worker()).kill()

    before = metrics(router.port).get('pdserve_router_migrations_total{outcome="resumed"}', 0.0)
    out = _streamed(_client(router.url), kill_the_busy_decode)
    assert_same_greedy_completion(out, _reference(cluster), f"the stream whose decode {what} was killed")
    assert len(out.ids) == 1 and out.usage.completion_tokens == STREAMED and out.choices[0].finish_reason == "length"
    after = metrics(router.port)
    assert after['pdserve_router_migrations_total{outcome="resumed"}'] == before + 1
    assert after["pdserve_router_migration_seconds_count"] >= 1
    (victim,) = killed
    old = cluster[victim]
    if what == "worker":  # an instance without its engine exits for its supervisor to restart it
        wait_for(lambda: old.proc.poll() is not None, 10, "the decode instance outlived its worker")
    _restart(cluster, victim, old)
    assert _complete(_client(router.url), "The opposite of hot is", 2).choices[0].text


def test_prefill_killed_after_its_first_token_the_stream_goes_on(cluster: dict) -> None:
    router = cluster["router"]
    served = _served(router)
    killed: list[str] = []

    def kill_the_prefill_that_served() -> None:
        now = _served(router)
        killed.append(next(n for n in ("p0", "p1") if now[cluster[n].url] > served[cluster[n].url]))
        cluster[killed[0]].kill()

    out = _streamed(_client(router.url), kill_the_prefill_that_served, after=1)
    assert_same_greedy_completion(out, _reference(cluster), "the stream whose prefill instance was killed")
    assert out.usage.completion_tokens == STREAMED
    _restart(cluster, killed[0], cluster[killed[0]])


def test_prefill_killed_with_requests_queued_they_complete_on_the_other(cluster: dict, embedded_tokenizer) -> None:
    router = cluster["router"]
    ids = embedded_tokenizer.encode(STORY * 12)
    prompts = [ids[i * 11:i * 11 + 400] for i in range(12)]  # 4 chunks each
    workers = {p: cluster[p].children("pdserve.worker") for p in ("p0", "p1")}
    for w in workers["p0"] + workers["p1"]:  # neither prefill computes: what each takes queues there
        w.suspend()
    in_flight = {}
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_complete, _client(router.url), p, 4) for p in prompts]
        try:
            wait_for(lambda: in_flight.update({p: i["in_flight_requests"] for p in ("p0", "p1")
                                               for i in router.registered() if i["url"] == cluster[p].url})
                     or max(in_flight.values()) >= 2, 30, "no requests queued on a prefill instance")
            victim, other = sorted(in_flight, key=in_flight.get, reverse=True)
            cluster[victim].kill()
        finally:
            for w in workers["p0"] + workers["p1"]:  # the victim's too: they follow their dead parent out
                w.resume()
        outs = [f.result() for f in futures]  # none fails: the victim's are retried on the other
    wait_for(lambda: cluster[victim].url not in router.healthy_urls(), 5, "the router kept a dead prefill instance")
    cluster[victim].wait_gone(20)
    with ThreadPoolExecutor(len(prompts)) as pool:
        reference = list(pool.map(lambda p: _complete(_client(cluster["mixed"].url), p, 4), prompts))
    assert_same_greedy_completions(outs, reference, min_share=0.8)  # prompts cut anywhere: a few start at a tie
    assert metrics(router.port)["pdserve_router_retries_total"] >= 1
    # the decode side of each abandoned attempt is released when its lease (10 s here) ends
    _blocks_free(cluster, [other, "d0", "d1"], 30)
