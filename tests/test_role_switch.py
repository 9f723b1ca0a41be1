"""Changing an instance's role in place (--enable-role-switch, POST /role): a prefill and a decode instance
behind a router change roles while requests run through it. No request fails across a change, greedy answers
equal a mixed instance's, the router's /registered shows each member's current role, and a change that
cannot drain, an unsigned one and one asked of an instance without the flag are refused and change nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve.http.members import post_signed
from tests.greedy import assert_same_greedy_completions
from tests.servers import Router, Server, segments, stop_all, wait_for

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
COMMON = ["--num-gpu-blocks-override", "300", "--max-model-len", "1024", "--max-num-seqs", "16"]
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are",
           "def fibonacci(n):", "Once upon a time, in a small village,", "The largest planet in the solar system is",
           "To make a cup of tea, first", "1, 2, 3, 4, 5,"]
LONG = "The river runs past the old mill, where the miller keeps a ledger of every sack of grain. " * 12


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    before = segments()
    tmp = tmp_path_factory.mktemp("role_switch")
    router = Router(tmp / "router")
    reg = ["--router", router.url, "--enable-role-switch", *COMMON]
    servers = {"prefill": Server(tmp / "p", "--splitwise-role", "prefill", *reg, wait=False),
               "decode": Server(tmp / "d", "--splitwise-role", "decode", *reg, wait=False),
               "mixed": Server(tmp / "m", *COMMON, wait=False)}  # the reference, not behind the router
    try:
        for server in servers.values():
            server.wait_ready(240)
        router.wait_pairs(2)
        yield {"router": router, **servers}
    finally:
        stop_all([*servers.values(), router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def change_role(url: str, role: str, drain_timeout: float = 0.0, signed: bool = True) -> httpx.Response:
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            if signed:
                return await post_signed(client, url, "/role", {"role": role, "drain_timeout": drain_timeout})
            return await client.post(f"{url}/role", json={"role": role})

    return asyncio.run(post())


def roles(router: Router) -> dict[str, tuple[str, bool]]:
    return {i["url"]: (i["role"], i["draining"]) for i in router.registered()}


def complete(url: str, prompt: str, max_tokens: int = 24) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2)


def run_all(url: str, prompts: list[str], while_running=None) -> list:  # noqa: ANN001
    """The prompts side by side through `url`; `while_running()` runs once they are under way."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, url, p) for p in prompts]
        result = None
        if while_running is not None:
            time.sleep(0.3)
            result = while_running()
        return [f.result() for f in futures], result


def test_roles_change_in_place_under_load_and_no_request_fails(deployment: dict) -> None:
    router, p, d, mixed = deployment["router"], deployment["prefill"], deployment["decode"], deployment["mixed"]
    prompts = [*PROMPTS, LONG[:700], LONG[100:900]]
    references = [complete(mixed.url, prompt) for prompt in prompts]

    # decode -> mixed while ten requests are in flight: they go on under the new role, none fails
    answers, changed = run_all(router.url, prompts, lambda: change_role(d.url, "mixed"))
    assert changed.status_code == 200, changed.text
    assert changed.json()["changed"] and changed.json()["role"] == "mixed"
    assert_same_greedy_completions(answers, references, min_share=0.75)
    assert roles(router) == {p.url: ("prefill", False), d.url: ("mixed", False)}
    assert httpx.get(f"{d.url}/role").json() == {"role": "mixed", "switchable": True, "changing": False}

    # P + mixed: the mixed instance takes whole requests and the decode side of P's
    answers, _ = run_all(router.url, prompts)
    assert_same_greedy_completions(answers, references, min_share=0.75)
    p_sent = _metric(p, "pdserve_kv_transfer_bytes_sent_total")
    assert p_sent > 0, "the prefill instance computed no prompt for the mixed one"

    # prefill -> decode after a drain, under load (mixed + decode, no prefill instance: both take whole requests)
    answers, changed = run_all(router.url, prompts, lambda: change_role(p.url, "decode", drain_timeout=60))
    assert changed.status_code == 200, changed.text
    assert_same_greedy_completions(answers, references, min_share=0.75)
    answers, _ = run_all(router.url, prompts)
    assert_same_greedy_completions(answers, references, min_share=0.75)
    assert _metric(p, "pdserve_requests_total") > 0, "the decode instance got no whole request"
    started = time.monotonic()
    assert change_role(p.url, "prefill").status_code == 200
    assert time.monotonic() - started < 5, "an idle instance took 5 s or more to change role"
    assert change_role(d.url, "decode").status_code == 200
    assert roles(router) == {p.url: ("prefill", False), d.url: ("decode", False)}
    answers, _ = run_all(router.url, prompts)
    assert_same_greedy_completions(answers, references, min_share=0.75)
    assert _metric(d, "pdserve_role_changes_total", outcome="ok") == 2


def test_a_change_that_cannot_drain_is_undone_and_bad_asks_are_refused(deployment: dict) -> None:
    router, d, mixed = deployment["router"], deployment["decode"], deployment["mixed"]
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=180)

    def long_answer() -> openai.types.Completion:
        return client.completions.create(model=MODEL, prompt="Count from one to a thousand: one, two,",
                                         max_tokens=400, temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_answer)
        wait_for(lambda: _metric(d, "pdserve_num_requests_running") > 0, 30, "the long answer did not start on D")
        workers = d.children("pdserve.worker")
        for w in workers:  # the answer cannot finish while the change waits, however fast the model
            w.suspend()
        try:
            refused = change_role(d.url, "mixed", drain_timeout=0.5)
        finally:
            for w in workers:
                w.resume()
        assert refused.status_code == 409, refused.text
        assert "stays decode" in refused.json()["error"]["message"]
        assert roles(router)[d.url] == ("decode", False), "the instance was not put back as it was"
        assert running.result().usage.completion_tokens == 400  # the answer in flight was not disturbed
    assert _metric(d, "pdserve_role_changes_total", outcome="failed") >= 1

    unsigned = change_role(d.url, "mixed", signed=False)
    assert unsigned.status_code == 403 and "role change refused" in unsigned.json()["error"]["message"]
    bad = change_role(d.url, "leader")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
    fixed = change_role(mixed.url, "prefill")
    assert fixed.status_code == 400 and "--enable-role-switch" in fixed.json()["error"]["message"]
    assert httpx.get(f"{mixed.url}/role").json()["switchable"] is False
    assert roles(router)[d.url] == ("decode", False)


def _metric(server: Server, name: str, **labels: str) -> float:
    from pdserve.planner.observe import total

    return total(httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).text, name, **labels)
