"""Prefix pulls between instances (`--enable-kv-pull`, issue 55): an instance told (the body's `kv_pull`, which
a router sets from its KV events) that a peer holds a prompt's prefix pulls it from the peer's host tier instead of
computing it: the answer equals the one the peer computed, the pulled tokens count as cached (tier "pulled"). A
peer that kept only part of the run serves that part; one killed while the puller waits on it makes the pull a
miss: the prompt is computed, the answer is the same, no block is lost, and the puller's other streams kept
decoding while it waited (the pull runs off the step). A router with two instances sends a
prompt's second turn to the other instance, which pulls. An instance without the flag answers 400 naming
`kv_pull`."""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest

from tests.greedy import assert_same_greedy_completion
from tests.servers import Router, Server, metrics, segments, stop_all, wait_for
from tests.test_swap_space import COMMON, _prompts

pytestmark = pytest.mark.e2e  # starts pdserve processes

PULL = ("--swap-space", "0.05", "--enable-kv-pull", "--dtype", "float32")


def _server(tmp_path: Path, name: str, *extra: str) -> Server:
    s = Server(tmp_path / name, *COMMON, *PULL, *extra, wait=False)
    s.wait_ready(240)
    return s


def _pull_addr(server: Server) -> str:
    match = re.search(r"serving host-tier blocks on port (\d+)", server.log())
    assert match, "the block server's port is not in the log"
    return f"127.0.0.1:{match.group(1)}"


def _complete(url: str, prompt: list[int], kv_pull: dict | None = None) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    return client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0,
                                     logprobs=2, extra_body={"kv_pull": kv_pull} if kv_pull else None)


def _token_times(url: str) -> list[float]:
    """A long streamed answer's chunk arrival times (monotonic)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Count: 1, 2, 3,", max_tokens=500,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    return [time.monotonic() for _ in stream]


def _saved_to_host(server: Server, blocks: int) -> None:
    wait_for(lambda: metrics(server.metrics_port).get("pdserve_host_cache_swap_out_blocks_total", 0) >= blocks, 10,
             "the prompt's blocks were not saved to the host tier")


def _tier(server: Server, tier: str) -> float:
    return metrics(server.metrics_port).get(f'pdserve_prefix_cache_hits_by_tier_total{{dp_rank="0",tier="{tier}"}}', 0)


def test_a_prefix_is_pulled_from_the_peer_that_holds_it_and_a_gone_peer_is_a_miss(tmp_path: Path) -> None:
    before = segments()
    a_prompt, b_prompt, c_prompt = _prompts()
    # 14 host blocks: three prompts of 6 blocks push the first one's last 4 out of the holder's host tier
    holder = _server(tmp_path, "holder", "--swap-space", "0.01")
    puller = _server(tmp_path, "puller", "--num-gpu-blocks-override", "48", "--max-model-len", "640")  # a long stream
    try:
        hint = {"addr": _pull_addr(holder), "num_blocks": 5}
        cold = {name: _complete(holder.url, p) for name, p in (("a", a_prompt), ("b", b_prompt), ("c", c_prompt))}
        _saved_to_host(holder, 18)

        whole = _complete(puller.url, c_prompt, hint)
        assert whole.usage.prompt_tokens_details.cached_tokens == 80  # 5 blocks pulled; the 6th computed
        assert_same_greedy_completion(whole, cold["c"], "the prompt whose prefix was pulled from a peer")
        wait_for(lambda: _tier(puller, "pulled") == 80, 10, "the pulled tokens were not counted by tier")

        part = _complete(puller.url, a_prompt, hint)  # the holder kept only its first 2 blocks
        assert part.usage.prompt_tokens_details.cached_tokens == 32
        assert_same_greedy_completion(part, cold["a"], "a prompt of which the peer held only the first blocks")
        wait_for(lambda: metrics(puller.metrics_port)["pdserve_kv_pulled_blocks_total"] == 7, 10, "pulled blocks")

        (service,) = holder.children("pdserve.disagg.cache_service")
        service.send_signal(signal.SIGSTOP)  # the holder's block server takes the pull and never answers...
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(_token_times, puller.url)  # another request, decoding all the while
            time.sleep(0.5)
            asked = time.monotonic()
            pending = pool.submit(_complete, puller.url, b_prompt, hint)
            time.sleep(1.0)  # ... the puller is waiting on it when the holder dies
            for p in [psutil.Process(holder.proc.pid), *psutil.Process(holder.proc.pid).children(recursive=True)]:
                p.send_signal(signal.SIGKILL)
            holder.proc.wait(10)
            missed = pending.result(timeout=60)
            times = streaming.result(timeout=60)
        assert missed.usage.prompt_tokens_details.cached_tokens == 0
        # The pull waited seconds for an answer (its deadline); the other stream's tokens kept coming meanwhile.
        assert times[-1] > asked + 2.0, "the other stream ended before the pull's wait: it shows nothing"
        gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > asked]
        assert max(gaps) < 1.0, f"the other stream stalled {max(gaps):.2f} s while the pull waited"
        assert_same_greedy_completion(missed, cold["b"], "a prompt whose holder died before the pull")
        wait_for(lambda: (m := metrics(puller.metrics_port))["pdserve_kv_pulls_failed_total"] == 1
                 and m["pdserve_kv_pulls_total"] == 3, 10, "the failed pull was not counted")
        again = _complete(puller.url, c_prompt)  # the puller is whole: its answers right, from its own cache now
        assert_same_greedy_completion(again, cold["c"], "the pulled prompt again, after a failed pull")
        wait_for(lambda: metrics(puller.metrics_port)["pdserve_kv_cache_free_blocks"]
                 == metrics(puller.metrics_port)["pdserve_kv_cache_total_blocks"], 10,
                 "the puller's blocks did not all come back")
    finally:
        stop_all([puller])  # checks that the puller leaves nothing behind
        if holder.proc.poll() is None:  # the test failed before it killed the holder
            holder.stop()
    for name in segments() - before:  # the SIGKILLed holder's: nobody was left to remove them
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_a_router_sends_the_next_turn_elsewhere_and_that_instance_pulls(tmp_path: Path) -> None:
    router = Router(tmp_path / "router", "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    servers = []
    try:
        servers = [_server(tmp_path, f"s{i}", "--router", router.url) for i in range(2)]
        wait_for(lambda: len(router.healthy_urls()) == 2, 30, "both instances did not join")
        prompt = _prompts()[0]
        first = _complete(router.url, prompt)
        wait_for(lambda: sum(metrics(s.metrics_port).get("pdserve_host_cache_swap_out_blocks_total", 0)
                             for s in servers) >= 6, 10, "the prompt's blocks were not saved to the host tier")
        wait_for(lambda: metrics(router.port).get("pdserve_router_kv_index_blocks", 0) >= 6, 10,
                 "the router's index did not learn of the blocks")
        second = _complete(router.url, prompt)  # round robin: the other instance
        assert second.usage.prompt_tokens_details.cached_tokens == 80
        assert_same_greedy_completion(second, first, "a prompt routed to the instance that pulled its prefix")
        wait_for(lambda: sum(_tier(s, "pulled") for s in servers) == 80, 10, "the pulled tokens were not counted")
    finally:
        stop_all([*servers, router])


def test_an_instance_without_pulls_refuses_the_field(tmp_path: Path) -> None:
    server = Server(tmp_path / "plain", *COMMON)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            _complete(server.url, _prompts()[0], {"addr": "127.0.0.1:9", "num_blocks": 5})
        assert "kv_pull" in str(e.value)
    finally:
        stop_all([server])
