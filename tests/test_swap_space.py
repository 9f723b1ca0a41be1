"""Seed 002's host prefix tier end to end (`--swap-space`): a mixed instance whose cache holds one
prompt at a time serves a prompt evicted from it out of host memory -- the hit is counted, the prompt's
tokens are reported cached (not computed again), and the output equals the cold run's. The same
sequence without the flag recomputes. On a decode instance the host tier feeds decode-side prefix
reuse: a returning prompt evicted from D's cache is loaded from D's host tier and P sends only the rest.
Nothing leaks: every block free, no shared-memory segment left. The flag without prefix caching exits 2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.greedy import assert_same_greedy_completion
from tests.servers import Router, Server, metrics, segments, stop_all, wait_for

pytestmark = pytest.mark.e2e  # starts pdserve processes
MODEL = "tiny"  # conftest.tiny_model: what is tested is the protocol, in fp32 exactly

# 8 blocks of 16 tokens; a 96-token prompt + 8 new tokens takes 7 of them, so each new prompt evicts the last
COMMON = ["--num-gpu-blocks-override", "8", "--max-model-len", "128", "--max-num-batched-tokens", "128"]
PARAGRAPHS = [
    "The river runs past the old mill, where the miller keeps a ledger of every sack of grain that he grinds. ",
    "A lighthouse keeper climbs two hundred steps each evening to light the lamp that guides the ships home. ",
    "In the library the oldest books are kept behind glass, and the librarian turns their pages with gloves. ",
]


def _prompts() -> list[list[int]]:
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_folder(None))
    return [tok.encode(p * 6)[:96] for p in PARAGRAPHS]


def _complete(url: str, prompt: list[int]) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     logprobs=2)


def _cycle(url: str) -> tuple[openai.types.Completion, openai.types.Completion]:
    """Prompt A cold, two other prompts that evict it from the cache, then A again."""
    a, b, c = _prompts()
    first = _complete(url, a)
    for other in (b, c):
        _complete(url, other)
    return first, _complete(url, a)


def _all_free(s: Server) -> bool:
    m = metrics(s.metrics_port)
    return m["pdserve_kv_cache_free_blocks"] == m["pdserve_kv_cache_total_blocks"]


def test_a_prefix_evicted_from_the_cache_is_served_from_the_host_tier(tmp_path: Path, tiny_model: list[str]) -> None:
    before = segments()
    tiered = Server(tmp_path / "tiered", *tiny_model, *COMMON, "--swap-space", "0.1", wait=False)
    plain = Server(tmp_path / "plain", *tiny_model, *COMMON, wait=False)
    try:
        for s in (tiered, plain):
            s.wait_ready(240)
        assert "host prefix tier (--swap-space):" in tiered.log()

        cold, warm = _cycle(tiered.url)
        assert_same_greedy_completion(warm, cold, "the prompt served from the host tier")
        assert warm.usage.prompt_tokens_details.cached_tokens == 80  # 5 full blocks; the 6th is computed
        wait_for(lambda: metrics(tiered.metrics_port).get("pdserve_host_cache_hit_blocks_total") == 5, 10,
                 "the host tier's hits were not counted")  # the metrics refresh every second
        m = metrics(tiered.metrics_port)
        assert m["pdserve_host_cache_swap_in_blocks_total"] == 5
        assert m["pdserve_host_cache_swap_out_blocks_total"] >= 3 * 5  # every prompt's full blocks were saved
        assert 0 < m["pdserve_host_cache_blocks_used"] <= m["pdserve_host_cache_blocks"]

        _, warm_plain = _cycle(plain.url)
        assert warm_plain.usage.prompt_tokens_details.cached_tokens == 0  # evicted: computed again
        assert_same_greedy_completion(warm_plain, cold, "the same prompt on an instance without the tier")
        assert "pdserve_host_cache_blocks" not in metrics(plain.metrics_port)  # no tier, no series of one
        for s in (tiered, plain):
            wait_for(lambda s=s: _all_free(s), 10, f"{s} did not give every block back")
    finally:
        stop_all([tiered, plain])
    assert segments() <= before, f"left behind: {segments() - before}"


def test_a_decode_instance_reuses_a_prompt_from_its_host_tier_and_p_sends_only_the_rest(tmp_path: Path,
                                                                                        tiny_model: list[str]) -> None:
    before = segments()
    router = Router(tmp_path / "router")
    reg = ["--router", router.url, "--cache-transfer-protocol", "ipc"]
    p = Server(tmp_path / "p", *tiny_model,
               "--splitwise-role", "prefill", *reg, *COMMON, "--num-gpu-blocks-override", "64",
               wait=False)
    d = Server(tmp_path / "d", *tiny_model,
               "--splitwise-role", "decode", *reg, *COMMON, "--swap-space", "0.1", wait=False)
    try:
        for s in (p, d):
            s.wait_ready(240)
        router.wait_pairs(2)
        cold, warm = _cycle(router.url)
        assert_same_greedy_completion(warm, cold, "the returning prompt")
        wait_for(lambda: metrics(d.metrics_port)["pdserve_kv_blocks_skipped_total"] == 5, 10,
                 "D did not find the evicted prompt in its host tier")
        assert metrics(d.metrics_port)["pdserve_host_cache_hit_blocks_total"] == 5
        for s in (p, d):
            wait_for(lambda s=s: _all_free(s), 10, f"{s} did not give every block back")
    finally:
        stop_all([p, d, router])
    assert segments() <= before, f"left behind: {segments() - before}"


def test_swap_space_without_prefix_caching_exits_2() -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--swap-space", "1",
                          "--no-enable-prefix-caching"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--swap-space" in out.stderr and "--enable-prefix-caching" in out.stderr
