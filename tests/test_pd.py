"""Prefill/decode disaggregation end to end: a router, a prefill instance and decode instances reached
over ipc, over tcp and (when NIXL is installed) over rdma twice -- UCX left to choose its transport, and
UCX_TLS=tcp as across hosts -- with different block counts, against a mixed instance.

Greedy output through the router must be the mixed instance's output. The two deployments differ
in batching (and so in float rounding), so where the texts part, the test requires that the mixed
instance's top two tokens were a near tie there (tests/greedy.py's HTTP_NEAR_TIE); any other difference fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import psutil
import pytest
import yaml

from pdserve.transport import rdma_available
from tests.greedy import (
    DEFAULT_IS_BF16,
    HTTP_NEAR_TIE,
    assert_same_greedy_completion,
    assert_same_greedy_completions,
    compare_greedy,
    top_two_gap,
)
from tests.servers import (
    BLOCK,
    BrokenInstance,
    Router,
    Server,
    free_port,
    metrics,
    register,
    segments,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`
NEEDS_NIXL = pytest.mark.skipif(not rdma_available(), reason="NIXL is not installed (make venv installs it)")

MODEL = "tiny"  # conftest.tiny_model, in fp32: P, D and mixed agree but for the last bits
CHUNK = 128  # --max-num-batched-tokens: prompts longer than this are prefilled in chunks
# A 10 s lease (30 by default): blocks of an aborted transfer come back 11 s later, not 31.
COMMON = ["--max-model-len", "1024", "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "32",
          "--pd-transfer-timeout", "10"]
MAX_TOKENS = 12
NIXL = rdma_available()
RDMA_PORT = free_port()
DECODES = ("decode_ipc", "decode_tcp", *(("decode_rdma", "decode_rdma_tcp") if NIXL else ()))

PARAGRAPH = ("The river runs past the old mill, where the miller keeps a ledger of every sack of grain. "
             "In spring the water rises, and the wheel turns faster than in any other season of the year. ")


SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    return Tokenizer(resolve_model_folder(None))


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, tiny_model: list[str]) -> Iterator[dict]:
    before = segments()
    tmp = tmp_path_factory.mktemp("pd")
    router = Router(tmp / "router")
    reg = ["--router", router.url]
    specs = {
        "prefill": ["--splitwise-role", "prefill", "--cache-transfer-protocol", "ipc,tcp,rdma" if NIXL else "ipc,tcp",
                    "--num-gpu-blocks-override", "400", *reg],
        # these two decode instances speculate on their own (n-gram): their answers must still be mixed's
        "decode_ipc": ["--splitwise-role", "decode", "--cache-transfer-protocol", "ipc",
                       "--num-gpu-blocks-override", "300", "--speculative-config", SPECULATIVE, *reg],
        "decode_tcp": ["--splitwise-role", "decode", "--cache-transfer-protocol", "tcp",
                       "--num-gpu-blocks-override", "200", "--speculative-config", SPECULATIVE, *reg],
        "mixed": ["--num-gpu-blocks-override", "400"],
    }
    env = {}
    if NIXL:
        specs["decode_rdma"] = ["--splitwise-role", "decode", "--cache-transfer-protocol", "rdma",
                                "--num-gpu-blocks-override", "250", *reg]
        specs["decode_rdma_tcp"] = [*specs["decode_rdma"], "--rdma-comm-ports", str(RDMA_PORT)]
        env["decode_rdma_tcp"] = {"UCX_TLS": "tcp"}  # as between hosts without RDMA NICs
    servers = {name: Server(tmp / name, *tiny_model, *flags, *COMMON, wait=False, env=env.get(name))
               for name, flags in specs.items()}
    try:
        for s in servers.values():
            s.wait_ready(240)
        router.wait_pairs(len(DECODES) + 1)
        yield {"router": router, **servers}
    finally:
        stop_all([*servers.values(), router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)


def _prompts(tokenizer) -> list[str | list[int]]:
    """20 prompts: short texts, lengths that are exact multiples of the block size (one of them the
    chunk budget), and prompts of several chunks."""
    text = PARAGRAPH * 12
    ids = tokenizer.encode(text)
    shorts = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are",
              "def fibonacci(n):", "Once upon a time, in a small village,", "The largest planet in the solar system is",
              "To make a cup of tea, first", "1, 2, 3, 4, 5,", "The opposite of hot is", "Monday, Tuesday,"]
    exact = [ids[:n] for n in (BLOCK, 2 * BLOCK, CHUNK, 2 * CHUNK)]
    offsets = [ids[i:i + n] for i, n in ((3, 5 * BLOCK + 1), (7, 3 * CHUNK + 5), (11, 700), (13, CHUNK + 1))]
    longs = [text[:900], text[200:1500]]
    return [*shorts, *exact, *offsets, *longs]


def _complete(client: openai.OpenAI, prompt: str | list[int]) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)


def test_pd_output_equals_mixed_for_20_concurrent_prompts(pd: dict, tokenizer) -> None:
    prompts = _prompts(tokenizer)
    assert len(prompts) == 20
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        pd_outs = list(pool.map(lambda p: _complete(router, p), prompts))
    with ThreadPoolExecutor(len(prompts)) as pool:
        mixed_outs = list(pool.map(lambda p: _complete(mixed, p), prompts))
    assert_same_greedy_completions(pd_outs, mixed_outs, min_share=0.8)
    # Every transport carried KV (each decode instance offers only one): the tiny model answers so fast that the
    # burst may miss one, so a few more, one at a time (the router breaks ties toward the less used). The API
    # port's /metrics asks the engine afresh (the --metrics-port exporter's figures are up to a second old).
    def received() -> dict[str, float]:
        return {n: metrics(pd[n].port)["pdserve_kv_transfer_bytes_received_total"] for n in DECODES}

    for i in range(2 * len(DECODES)):
        if all(v > 0 for v in received().values()):
            break
        assert_same_greedy_completions([_complete(router, prompts[i])], [mixed_outs[i]], min_share=0.8)
    got = received()
    assert all(v > 0 for v in got.values()), got
    assert metrics(pd["prefill"].port)["pdserve_kv_transfer_bytes_sent_total"] == sum(got.values())
    # The n-gram decode instances propose once a token recurs. A random model's 12-token answers may hold none, so
    # long answers follow until one did (400 tokens after a 300-token prompt: a repeat is all but certain).
    def drafts() -> float:
        return sum(metrics(pd[n].port)["pdserve_spec_decode_num_drafts_total"] for n in ("decode_ipc", "decode_tcp"))

    long = tokenizer.encode(PARAGRAPH * 12)[:300]
    for _ in range(6):
        if drafts() > 0:
            break
        ask = dict(model=MODEL, prompt=long, max_tokens=400, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        assert_same_greedy_completion(router.completions.create(**ask), mixed.completions.create(**ask),
                                      "a long answer through a speculating decode instance")
    assert drafts() > 0, "the speculating decode instances proposed nothing"
    _assert_all_blocks_free(pd)


def test_reading_status_during_pd_load_takes_nothing_from_the_metrics(pd: dict) -> None:
    """/status and /metrics read the same figures; a read changes none: every transfer lands in both sides'
    histograms however often /status is read meanwhile, and what only grows is typed counter."""
    names = ["prefill", *DECODES]
    count = "pdserve_kv_transfer_seconds_count"
    before = {n: metrics(pd[n].port).get(count, 0) for n in names}  # the API port's: asked afresh
    stop, reads = False, 0

    def read_status() -> None:
        nonlocal reads
        while not stop:
            for n in names:
                assert httpx.get(f"{pd[n].url}/status", timeout=10).status_code == 200
                reads += 1

    router = _client(pd["router"].url)
    with ThreadPoolExecutor(3) as pool:
        reader = pool.submit(read_status)
        list(pool.map(lambda i: router.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=4,
                                                          temperature=0), range(8)))
        stop = True
        reader.result()
    assert reads >= len(names)

    def got() -> dict[str, float]:
        return {n: metrics(pd[n].port).get(count, 0) - before[n] for n in names}

    # D's histogram gets a transfer when P's prefill-done arrives, which can come just after the answer
    wait_for(lambda: (g := got())["prefill"] >= 8 and sum(g[n] for n in DECODES) >= 8, 10,
             f"every transfer in the histograms: {got()}")
    assert got()["prefill"] == 8 and sum(got()[n] for n in DECODES) == 8, got()
    text = httpx.get(f"http://127.0.0.1:{pd['prefill'].metrics_port}/metrics", timeout=10).text
    for counter in ("pdserve_kv_transfers_ok", "pdserve_kv_transfer_bytes_sent", "pdserve_prefix_cache_hits",
                    "pdserve_num_preemptions"):
        assert f"# TYPE {counter}_total counter" in text, counter


@NEEDS_NIXL
def test_rdma_comm_ports_is_where_the_decode_instances_ucx_listens(pd: dict) -> None:
    (service,) = pd["decode_rdma_tcp"].children("pdserve.disagg.cache_service")
    listening = {c.laddr.port for c in service.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert RDMA_PORT in listening, listening


def test_prefix_cache_hits_on_prefill_are_sent_whole(pd: dict, tokenizer) -> None:
    """A prompt sharing a long prefix with an earlier one: P serves the prefix from its cache (never
    computed by this request) and must still send those blocks."""
    ids = tokenizer.encode(PARAGRAPH * 10)
    first, second = ids[:300], ids[:300] + tokenizer.encode(" And so the story of the mill ends")
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)
    hits_before = metrics(pd["prefill"].port)["pdserve_prefix_cache_hits_total"]  # the API port's: fresh
    for prompt in (first, second, second):  # the second `second` goes to the other decode instance
        assert_same_greedy_completion(_complete(router, prompt), _complete(mixed, prompt), "prefix prompt")
    wait_for(lambda: metrics(pd["prefill"].port)["pdserve_prefix_cache_hits_total"] - hits_before >= 2 * 288,
             5, "P did not serve 18 full blocks of 16 from its prefix cache, twice at least")
    _assert_all_blocks_free(pd)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_completion_through_the_router(pd: dict, stream: bool) -> None:
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def chat(client: openai.OpenAI) -> str:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                             stream=stream)
        if not stream:
            return out.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)

    def completion(client: openai.OpenAI) -> str:
        out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                        temperature=0, stream=stream)
        return out.choices[0].text if not stream else "".join(c.choices[0].text for c in out if c.choices)

    for call in (chat, completion):
        text = call(router)
        assert text and text == call(mixed)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_content_as_text_parts_through_the_router(pd: dict, stream: bool) -> None:
    """The shape vLLM's `bench serve --backend openai-chat` and many SDKs send: content as a list of parts,
    joined in order. An image part is a 400 that names it."""
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    joined = "What is the capital\nof France?"

    def chat(client: openai.OpenAI, content: object) -> str:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                             max_tokens=10, temperature=0, stream=stream)
        if not stream:
            return out.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)

    text = chat(router, parts)
    assert text and text == chat(mixed, joined) == chat(mixed, parts)
    image = [*parts, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(router, image)
    assert "image_url" in e.value.body["message"] and "text parts only" in e.value.body["message"]


def test_router_models_health_and_bad_input(pd: dict) -> None:
    router = _client(pd["router"].url)
    assert [m.id for m in router.models.list().data] == [MODEL]
    assert httpx.get(f"{pd['router'].url}/health").status_code == 200
    with pytest.raises(openai.BadRequestError) as e:
        router.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.body["message"]
    r = httpx.post(f"{pd['router'].url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "error" in r.json()


def test_n_choices_and_timings_through_the_router(pd: dict) -> None:
    r = httpx.post(f"{pd['router'].url}/v1/completions", timeout=120, json={
        "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "n": 2, "collect_metrics": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len({c["text"] for c in body["choices"]}) == 1  # greedy: both choices the same
    m = body["metrics"]
    # D's own moments and P's, in the order they happen
    order = ["preallocated", "cache_info_sent", "first_layer_written", "last_layer_written", "prefill_done_received",
             "last_token"]
    times = [m[k] for k in order]
    assert times == sorted(times), m


def test_prefill_that_breaks_mid_request_is_retried_and_leaves_the_pool(pd: dict) -> None:
    """A prefill instance that passes health checks but drops its requests: the router tries the
    request again on the live prefill instance (the client sees only a 200), takes the broken one out
    of the pool at once, and the decode instance's blocks of the failed attempt come back."""
    router = pd["router"]
    (prefill,) = [i for i in router.registered() if i["role"] == "prefill"]
    broken = BrokenInstance()
    try:
        assert register(router.url, {**prefill, "url": broken.url, "pid": 1}).status_code == 200
        wait_for(lambda: broken.url in router.healthy_urls(), 10, "the broken instance did not join the pool")
        retries = metrics(router.port).get("pdserve_router_retries_total", 0.0)
        for _ in range(2):  # least tokens, ties to the less used: one of the two goes to the broken one
            start = time.monotonic()
            r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                           json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert time.monotonic() - start < 10
        assert broken.url not in router.healthy_urls()
        assert metrics(router.port)["pdserve_router_retries_total"] == retries + 1
    finally:
        register(router.url, {"url": broken.url}, path="/unregister")
        broken.close()
    _assert_all_blocks_free(pd, timeout=25)  # the aborted D request's blocks: quarantined for the (10 s) lease


def _assert_all_blocks_free(pd: dict, timeout: float = 15) -> None:
    """Every instance gives all its blocks back (P after D's acknowledgement)."""
    for name in ("prefill", *DECODES, "mixed"):
        port = pd[name].metrics_port

        def free(port: int = port) -> bool:
            m = metrics(port)
            return m["pdserve_kv_cache_free_blocks"] == m["pdserve_kv_cache_total_blocks"]

        wait_for(free, timeout, f"{name} did not free all its KV blocks")


# ---- faults and small caches -----------------------------------------------------------------


def _pair(tmp: Path, model: list[str], protocol: str, d_blocks: int, timeout: float = 4
          ) -> tuple[Router, Server, Server]:
    router = Router(tmp / "router")
    flags = [*model, *COMMON, "--max-model-len", "512", "--cache-transfer-protocol", protocol, "--router", router.url,
             "--pd-transfer-timeout", str(timeout)]
    p = Server(tmp / "p", "--splitwise-role", "prefill", "--num-gpu-blocks-override", "200", *flags, wait=False)
    d = Server(tmp / "d", "--splitwise-role", "decode", "--num-gpu-blocks-override", str(d_blocks), *flags, wait=False)
    try:
        p.wait_ready(240)
        d.wait_ready(240)
        router.wait_pairs(2)
    except BaseException:
        for s in (p, d, router):
            s.proc.kill()
        raise
    return router, p, d


def _long_prompt(tokenizer, n: int, offset: int = 0) -> list[int]:
    """n tokens of the paragraph text from `offset` on (prompts with different offsets share no prefix block)."""
    return tokenizer.encode(PARAGRAPH * 40)[offset:offset + n]


def _fault_during_prefill(router: Router, p: Server, d: Server, prompt: list[int],
                          fault: Callable[[psutil.Process], None]) -> tuple[str, float]:
    """Send a PD request while P's worker is stopped (so the prefill cannot finish first); once D has
    preallocated and P has handed the first chunk to its worker, inject `fault(p's worker)`.
    Returns what the client got and how long it took."""
    (worker,) = p.children("pdserve.worker")
    worker.suspend()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_stream_error, router.url, prompt)
        wait_for(lambda: metrics(d.metrics_port)["pdserve_num_requests_preallocated"] == 1, 30,
                 "D did not preallocate")
        time.sleep(1)  # P's engine takes the cache info and hands the first chunk to its (stopped) worker
        fault(worker)
        return answer.result()


def _stream_error(url: str, prompt: list[int]) -> tuple[str, float]:
    """Stream a completion; returns (everything received, seconds until the answer ended)."""
    start = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}) as r:
            text = r.read().decode()
    except httpx.HTTPError as e:
        text = f"transport error: {e}"
    return text, time.monotonic() - start


@pytest.mark.parametrize("protocol", ["ipc"])  # queueing is the engine's; rdma's failures: killed_decode below
def test_small_decode_cache_queues_then_serves_and_killed_prefill_frees_decode_blocks(tmp_path: Path, tokenizer,
                                                                                         protocol: str,
                                                                                         tiny_model: list[str]) -> None:
    before = segments()
    router, p, d = _pair(tmp_path, tiny_model, protocol, d_blocks=40)  # one 450-token prompt takes 29 of D's 40 blocks
    try:
        # different starts: D's prefix cache must not share blocks between them (it would, from one start)
        prompts = [_long_prompt(tokenizer, 450 + i, offset=5 * i) for i in range(3)]
        client = httpx.Client(timeout=120)

        def run(prompt: list[int]) -> dict:
            r = client.post(f"{router.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                                  "temperature": 0, "collect_metrics": True})
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(run, prompts))
        spans = sorted((o["metrics"]["preallocated"], o["metrics"]["finished"]) for o in outs)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end, f"D held blocks for two 29-block requests at once: {spans}"
        assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)

        # Kill P during a prefill: D frees its preallocated blocks, and the router, the client having seen nothing
        # yet, sends the request again: with no prefill instance left, the decode instance computes it whole.
        def kill_prefill(worker: psutil.Process) -> None:
            p.kill()
            worker.kill()

        text, seconds = _fault_during_prefill(router, p, d, _long_prompt(tokenizer, 440), kill_prefill)
        assert '"finish_reason": "length"' in text and text.rstrip().endswith("[DONE]"), text
        assert seconds < 30
        wait_for(lambda: metrics(d.metrics_port)["pdserve_kv_cache_free_blocks"] == 40, 15,
                 "D did not free its preallocated blocks after P died")
        p.wait_gone()
    finally:
        for s in (d, router):
            s.stop()
        if p.proc.poll() is None:
            for w in p.children("pdserve.worker"):
                w.resume()
            p.stop()
    assert segments() <= before


@pytest.mark.parametrize("protocol", ["tcp", pytest.param("rdma", marks=NEEDS_NIXL)])
def test_killed_decode_frees_prefill_blocks(tmp_path: Path, tokenizer, protocol: str, tiny_model: list[str]) -> None:
    before = segments()
    router, p, d = _pair(tmp_path, tiny_model, protocol, d_blocks=100)
    try:
        # P's worker resumes once D is dead, so the KV has nowhere to go.
        def kill_decode(worker: psutil.Process) -> None:
            d.kill()
            worker.resume()

        text, seconds = _fault_during_prefill(router, p, d, _long_prompt(tokenizer, 440), kill_decode)
        assert "PD error" in text, text
        assert seconds < 30
        d.wait_gone()
        wait_for(lambda: metrics(p.metrics_port)["pdserve_kv_cache_free_blocks"] == 200, 20,
                 "P did not free its blocks after D died")
        # P still serves plain requests
        r = httpx.post(f"{p.url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        for w in p.children("pdserve.worker"):
            w.resume()
        for s in (p, router):
            s.stop()
        if d.proc.poll() is None:
            d.stop()
    assert segments() <= before


# ---- what apps send, through a PD pair ------------------------------------------------------------

APP_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "genres": {"type": "array", "items": {"type": "string", "enum": ["drama", "comedy", "action"]},
               "minItems": 1, "maxItems": 2}},
    "required": ["title", "year", "genres"], "additionalProperties": False}
APP_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
    "additionalProperties": False}}}


def test_structured_output_and_tool_calls_through_pd_equal_mixed(pd: dict) -> None:
    """P samples the first token under the grammar and D's matcher continues from it: the answer is a
    mixed instance's (up to a near tie, tests/greedy.py), streamed or not, and it validates."""
    ask = [{"role": "user", "content": "Describe a film you like as JSON."}]
    requests = [
        dict(messages=ask, response_format={"type": "json_schema",
                                            "json_schema": {"name": "film", "schema": APP_SCHEMA}}),
        dict(messages=[{"role": "user", "content": "Weather in Madrid?"}], tools=[APP_TOOL], tool_choice="required",
             parallel_tool_calls=False),
        dict(messages=ask, extra_body={"guided_choice": ["yes", "no"]}),
    ]
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)
    answers = []
    for kw in requests:
        got, want = (c.chat.completions.create(model=MODEL, max_tokens=60, temperature=0, logprobs=True, top_logprobs=2,
                                               **kw).choices[0] for c in (router, mixed))
        _assert_same_greedy_chat(got, want)
        answers.append(got)
        if "tools" in kw or DEFAULT_IS_BF16:  # in bf16 two decode instances may round a near tie either way
            continue
        streamed = [c for c in router.chat.completions.create(model=MODEL, max_tokens=60, temperature=0, stream=True,
                                                              **kw) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == got.message.content
    jsonschema.validate(json.loads(answers[0].message.content), APP_SCHEMA)
    assert answers[1].finish_reason == "tool_calls"
    assert [c.function.name for c in answers[1].message.tool_calls] == ["get_weather"]
    assert answers[2].message.content in ("yes", "no")
    _assert_all_blocks_free(pd)


def test_two_functions_required_through_pd_end_as_mixed(pd: dict) -> None:
    """Issue 41's request through the pair: D's guard (closed objects, bounded numbers, distinct calls)
    continues from P's first token and the calls end within max_tokens as on a mixed instance."""
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    kw = dict(messages=[{"role": "user", "content": "What is 1 + 2?"}], tools=[add, APP_TOOL], tool_choice="required")
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)
    got, want = (c.chat.completions.create(model=MODEL, max_tokens=200, temperature=0, logprobs=True, top_logprobs=2,
                                           **kw).choices[0] for c in (router, mixed))
    _assert_same_greedy_chat(got, want)
    assert got.finish_reason == "tool_calls" and got.message.tool_calls
    schemas = {t["function"]["name"]: {**t["function"]["parameters"], "additionalProperties": False}
               for t in (add, APP_TOOL)}
    for c in got.message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    assert len({(c.function.name, c.function.arguments) for c in got.message.tool_calls}) == len(got.message.tool_calls)
    _assert_all_blocks_free(pd)


def _assert_same_greedy_chat(got, want) -> None:  # noqa: ANN001 - openai chat choices asked with top_logprobs=2
    compare_greedy([t.token for t in want.logprobs.content], [t.token for t in got.logprobs.content],
                   lambda i: top_two_gap(t.logprob for t in want.logprobs.content[i].top_logprobs), HTTP_NEAR_TIE,
                   "PD against mixed")


def test_scoring_tokenize_and_ids_through_the_router(pd: dict) -> None:
    """Echo + logprobs go to one instance (the prefill instance here: it computes prompts) and equal the
    mixed instance's; /tokenize is answered; ids are unique across instances."""
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)
    prompt = "The river runs past the old mill, where the miller keeps"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1, temperature=0)
    via_router, direct = router.completions.create(**kw), mixed.completions.create(**kw)
    assert via_router.choices[0].logprobs.tokens == direct.choices[0].logprobs.tokens
    assert via_router.choices[0].logprobs.token_logprobs[0] is None
    assert via_router.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        direct.choices[0].logprobs.token_logprobs[1:], abs=0.05)
    tok = httpx.post(f"{pd['router'].url}/tokenize", json={"prompt": prompt}).json()
    assert httpx.post(f"{pd['router'].url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == prompt

    def ids(client: openai.OpenAI, n: int) -> list[str]:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda _: client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).id,
                                 range(n)))

    all_ids = ids(router, 200) + ids(mixed, 800)
    assert len(set(all_ids)) == 1000
    _assert_all_blocks_free(pd)


def test_seeded_sampling_through_pd_equals_mixed(pd: dict) -> None:
    """P draws the first token's random number, D continues the same generator: a seeded sampled answer is
    the mixed instance's (and different seeds differ)."""
    router, mixed = _client(pd["router"].url), _client(pd["mixed"].url)

    def texts(client: openai.OpenAI, seed: int) -> list[str]:
        return [client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed,
                                          top_p=0.95).choices[0].text
                for prompt in ("Once upon a time", "The best way to learn a language is")]

    through_pd = texts(router, 11)
    assert through_pd == texts(mixed, 11)
    assert through_pd != texts(mixed, 12)


def test_conditional_pd_prefills_short_and_cached_prompts_on_decode(pd: dict, tokenizer, tmp_path: Path) -> None:
    """`--pd-policy conditional`: a short prompt, and one whose prefix D already holds, are computed on D itself;
    a long one on P. The answers equal the mixed instance's and the router counts each decision."""
    from pdserve.http.wire import Registration

    pair = {pd["prefill"].port, pd["decode_ipc"].port}
    infos = [i for i in pd["router"].registered() if int(i["url"].rsplit(":", 1)[1]) in pair]
    listing = tmp_path / "instances.yaml"
    listing.write_text(yaml.safe_dump({"instances": [{k: i[k] for k in Registration.model_fields} for i in infos]}))
    router = Router(tmp_path / "router", "--pd-policy", "conditional", "--max-local-prefill-length", "64",
                    "--instances", str(listing), "--health-interval", "0.5")
    try:
        router.wait_pairs(2)
        mixed, conditional = _client(pd["mixed"].url), _client(router.url)
        ids = tokenizer.encode(PARAGRAPH * 10)
        short, long = "The largest planet in the solar system is", ids[5:305]
        cached = long + tokenizer.encode(" And so the story of the mill ends")
        hits_before = metrics(pd["decode_ipc"].port)["pdserve_prefix_cache_hits_total"]  # the API port's: fresh
        for prompt, where in ((short, "local"), (long, "remote"), (cached, "local")):
            out = conditional.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 logprobs=2, extra_body={"collect_metrics": True})
            assert_same_greedy_completion(out, _complete(mixed, prompt), f"{where} prefill")
            timings = out.model_extra["metrics"]
            assert ("preallocated" in timings) == (where == "remote"), timings  # a PD request's phases
        m = metrics(router.port)
        decisions = {(w, r): m.get(f'pdserve_router_prefill_decisions_total{{reason="{r}",where="{w}"}}', 0.0)
                     for w, r in (("local", "short"), ("remote", "long"), ("local", "cached"))}
        assert decisions == {("local", "short"): 1, ("remote", "long"): 1, ("local", "cached"): 1}, m
        # D computed only the new tail of `cached`: the blocks P had sent it came from its prefix cache
        wait_for(lambda: metrics(pd["decode_ipc"].port)["pdserve_prefix_cache_hits_total"] - hits_before
                 >= (300 // BLOCK) * BLOCK, 5, "D did not serve the long prompt's blocks from its prefix cache")
    finally:
        stop_all([router])
    _assert_all_blocks_free(pd)
