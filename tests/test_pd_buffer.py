"""Seed 002's decode host buffer end to end: a decode instance with a small cache and
--splitwise-cache-buffer-size takes P's KV into the buffer, releases P at once, and copies a
request's KV into its cache only when the request can decode.

Seven concurrent PD requests whose KV fits D's cache one at a time: every prefill is done (P holds
nothing) before D has finished decoding the first; output equals a mixed instance's; at the end
every buffer and cache block is free; a repeated prompt moves only the blocks D's prefix cache
lacks. D killed with requests in its buffer: P frees everything and serves on, no segment is left.
The flag on a prefill instance exits 2.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.greedy import assert_same_greedy_completions
from tests.servers import Router, Server, metrics, segments, stop_all, wait_for

pytestmark = pytest.mark.e2e  # starts pdserve processes
MODEL = "tiny"  # conftest.tiny_model: what is tested is the protocol, in fp32 exactly

COMMON = ["--max-model-len", "256", "--max-num-batched-tokens", "256", "--max-num-seqs", "16"]
PROMPT_LEN, NEW_TOKENS, REQUESTS = 128, 48, 5  # 5 x 8 buffer blocks, one request at a time in D's 16
# Answers long enough that D, decoding one request at a time, keeps the others waiting in its buffer for seconds
# (48 tokens took D ~0.4 s a request on the AVX-512 box: the buffer then seldom held 3 at once)
LONG_ANSWER = 256 - PROMPT_LEN
PARAGRAPH = ("The river runs past the old mill, where the miller keeps a ledger of every sack of grain. "
             "In spring the water rises, and the wheel turns faster than in any other season of the year. ")


def _prompts() -> list[list[int]]:
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    ids = Tokenizer(resolve_model_folder(None)).encode(PARAGRAPH * 20)
    return [ids[i:i + PROMPT_LEN] for i in range(REQUESTS)]


def _run(url: str, prompts: list[list[int]]) -> list[openai.types.Completion]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)

    def one(prompt: list[int]) -> openai.types.Completion:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS,
                                         temperature=0, logprobs=2,
                                         extra_body={"ignore_eos": True, "collect_metrics": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_decode_buffer_releases_prefill_early_and_decodes_like_mixed(tmp_path: Path, tiny_model: list[str]) -> None:
    before = segments()
    router = Router(tmp_path / "router")
    reg = ["--router", router.url, "--cache-transfer-protocol", "ipc"]
    # D's cache: 16 blocks of 16 tokens = one 176-token request at a time; the buffer takes all five prompts
    p = Server(tmp_path / "p", *tiny_model,
               "--splitwise-role", "prefill", "--num-gpu-blocks-override", "200", *reg, *COMMON,
               "--max-num-batched-tokens", "1280", wait=False)  # all five prompts in one step
    d = Server(tmp_path / "d", *tiny_model, "--splitwise-role", "decode", "--num-gpu-blocks-override", "16",
               "--splitwise-cache-buffer-size", "0.25", *reg, *COMMON, wait=False)
    mixed = Server(tmp_path / "mixed", *tiny_model, "--num-gpu-blocks-override", "200", *COMMON, wait=False)
    try:
        for s in (p, d, mixed):
            s.wait_ready(240)
        router.wait_pairs(2)
        assert "splitwise cache buffer:" in d.log()
        prompts = _prompts()
        pd_out = _run(router.url, prompts)
        mixed_out = _run(mixed.url, prompts)

        times = [o.model_extra["metrics"] for o in pd_out]
        assert all("buffered" in t and t["buffered"] <= t["swap_started"] <= t["swapped_in"] for t in times), times
        last_in_buffer = max(t["buffered"] for t in times)
        first_done = min(t["finished"] for t in times)
        assert last_in_buffer < first_done, (f"P was still holding KV {last_in_buffer - first_done:.2f} s after D "
                                             "finished its first request")
        print(f"all KV in D's buffer {first_done - last_in_buffer:.2f} s before D finished its first request")
        assert all(len(got.choices[0].logprobs.tokens) == NEW_TOKENS for got in pd_out)
        assert_same_greedy_completions(pd_out, mixed_out, min_share=0.8)

        def all_free() -> bool:
            mp, md = metrics(p.metrics_port), metrics(d.metrics_port)
            return (mp["pdserve_kv_cache_free_blocks"] == mp["pdserve_kv_cache_total_blocks"]
                    and md["pdserve_kv_cache_free_blocks"] == md["pdserve_kv_cache_total_blocks"]
                    and md["pdserve_splitwise_buffer_blocks_used"] == 0)

        wait_for(all_free, 15, "a cache or buffer block was not given back")
        # From here the API ports' /metrics, which ask the engines afresh (the exporters' figures lag a second).
        m = metrics(d.port)
        assert m["pdserve_splitwise_buffer_blocks"] >= REQUESTS * PROMPT_LEN // 16
        assert m["pdserve_kv_swap_in_bytes_total"] > 0

        # A later turn with the same prefix on the same D: D's prefix cache has its first blocks, so P
        # sends only the rest, and the answer is the same.
        last = max(range(REQUESTS), key=lambda i: times[i]["finished"])
        sent_before = metrics(p.port)["pdserve_kv_transfer_bytes_sent_total"]
        (again,) = _run(router.url, [prompts[last]])
        assert again.choices[0].text == pd_out[last].choices[0].text
        skipped = (PROMPT_LEN - 1) // 16  # full blocks, one token left for P's logits
        wait_for(lambda: metrics(d.port)["pdserve_kv_blocks_skipped_total"] == skipped, 10,
                 "D did not use its prefix cache")
        wait_for(lambda: metrics(p.port)["pdserve_kv_transfer_bytes_sent_total"] > sent_before, 10, "P sent nothing")
        sent = metrics(p.port)["pdserve_kv_transfer_bytes_sent_total"] - sent_before
        block_bytes = m["pdserve_kv_swap_in_bytes_total"] / REQUESTS / (PROMPT_LEN // 16)
        assert sent == block_bytes * (PROMPT_LEN // 16 - skipped)  # the one block D lacked
    finally:
        stop_all([p, d, mixed, router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def test_the_buffer_flag_on_a_prefill_instance_exits_2() -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--splitwise-role", "prefill",
                          "--splitwise-cache-buffer-size", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--splitwise-cache-buffer-size is for decode instances" in out.stderr


def test_decode_killed_with_requests_in_its_buffer_leaves_prefill_whole(tmp_path: Path, tiny_model: list[str]) -> None:
    before = segments()
    router = Router(tmp_path / "router")
    # A short lease, so P gives up soon after D dies. On a slow box P's first step (six 128-token prompts,
    # fp32, D beside P) outlasted it in stop 21 and every transfer failed; P now renews from inside a step.
    reg = ["--router", router.url, "--cache-transfer-protocol", "ipc", "--pd-transfer-timeout", "4"]
    p = Server(tmp_path / "p", *tiny_model,
               "--splitwise-role", "prefill", "--num-gpu-blocks-override", "200", *reg, *COMMON,
               "--max-num-batched-tokens", "1280", wait=False)
    d = Server(tmp_path / "d", *tiny_model, "--splitwise-role", "decode", "--num-gpu-blocks-override", "16",
               "--splitwise-cache-buffer-size", "0.25", *reg, *COMMON, wait=False)
    try:
        for s in (p, d):
            s.wait_ready(240)
        router.wait_pairs(2)

        def one(prompt: list[int]) -> int:
            try:
                return httpx.post(f"{router.url}/v1/completions", timeout=60, json={
                    "prompt": prompt, "max_tokens": LONG_ANSWER, "temperature": 0, "ignore_eos": True}).status_code
            except httpx.HTTPError:
                return 0

        with ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(one, prompt) for prompt in _prompts()[:6]]
            # the API port's figures are fresh: the exporter's, a second old, could miss a buffer that drains fast
            wait_for(lambda: metrics(d.port)["pdserve_num_requests_buffered"] >= 3, 60,
                     "no request waited in D's buffer")
            d.kill()
            statuses = [a.result() for a in answers]
        assert any(s != 200 for s in statuses), statuses  # the buffered ones died with D
        d.wait_gone()  # D's processes are gone, its cache and buffer segments too
        wait_for(lambda: metrics(p.metrics_port)["pdserve_kv_cache_free_blocks"] == 200, 30,
                 "P did not free its blocks after D died")
        r = httpx.post(f"{p.url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200  # P serves on
    finally:
        stop_all([s for s in (p, d, router) if s.proc.poll() is None])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"
