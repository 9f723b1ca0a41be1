"""The SLA planner end to end: `pdserve launch --prefill 1 --decode 1 --planner` under a two-phase load. Long
prompts with short answers move capacity to the prompt side (the decode instance turns mixed), then short prompts
with long answers move it to the decode side (the prefill instance turns decode); the router's /registered shows
each member's role, no request fails across the changes, and greedy answers equal the fixed 1P1D's before it moved.

The profile is a file with round numbers (1,000 prompt tokens/s, ITL 10 ms + 2 ms a stream) so the sizing is
clear-cut on any box: the test is of the loop that reads, predicts, decides and acts, not of this machine's speed
(bench/planner.py measures with the instances' own calibration).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.planner.observe import total
from pdserve.planner.sizing import DeploymentProfile
from tests.greedy import assert_same_greedy_completions
from tests.servers import segments, wait_for
from tests.test_launch import Launch

pytestmark = pytest.mark.e2e

MODEL = "tiny"  # conftest.tiny_model: the loop under test is the planner's, not the model's
INTERVAL = 3.0
PROFILE = DeploymentProfile(prefill_tokens_per_s=1000.0, itl_base_s=0.010, itl_per_stream_s=0.002, max_streams=32)
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are",
           "def fibonacci(n):", "Once upon a time, in a small village,", "To make a cup of tea, first"]
WORDS = "river mill ledger grain spring water wheel season miller sack harvest road stone bridge".split()


class Phase(threading.Thread):
    """`clients` threads sending prompts of about `prompt_words` words for `max_tokens`, until stopped."""

    def __init__(self, url: str, clients: int, prompt_words: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.clients, self.words, self.max_tokens = url, clients, prompt_words, max_tokens
        self.results: list[tuple[int, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        threads = [threading.Thread(target=self._client, args=(random.Random(i),)) for i in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _client(self, rng: random.Random) -> None:
        with httpx.Client(timeout=180) as http:
            while not self.stop.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(self.words))  # no two share a prefix
                try:
                    r = http.post(f"{self.url}/v1/completions", json={
                        "model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                        "ignore_eos": True})
                    self.results.append((r.status_code, r.text[:300]))
                except httpx.HTTPError as e:
                    self.results.append((0, repr(e)))

    def end(self) -> list[tuple[int, str]]:
        self.stop.set()
        self.join()
        return [r for r in self.results if r[0] != 200]


def greedy(url: str) -> list:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)
    return [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, logprobs=2)
            for p in PROMPTS]


def test_the_planner_moves_capacity_the_way_each_phase_needs(tmp_path: Path, tiny_model: list[str]) -> None:
    before = segments()
    PROFILE.save(tmp_path / "profile.json")
    launch = Launch(tmp_path, *tiny_model, "--prefill", "1", "--decode", "1", "--routers", "1", "--planner",
                    "--planner-interval", str(INTERVAL), "--planner-profile", str(tmp_path / "profile.json"),
                    "--planner-ttft-slo-ms", "2000", "--planner-tpot-slo-ms", "30",
                    "--num-gpu-blocks-override", "600", "--max-model-len", "2048", "--max-num-seqs", "32")
    try:
        _two_phases(launch)
        launch.proc.send_signal(signal.SIGINT)  # Ctrl-C: everything stops and cleans up
        assert launch.proc.wait(60) == 130, launch.log()[-3000:]
    finally:
        launch.kill()
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def _two_phases(launch: Launch) -> None:
    def roles() -> list[str]:
        return sorted(i["role"] for i in launch.instances().values())

    fixed = greedy(launch.url)  # the 1P1D as launched
    assert roles() == ["decode", "prefill"]

    # phase A: ~1,500-token prompts, 16-token answers (the profile computes one in 1.5 s: prefill-bound)
    long_prompts = Phase(launch.url, clients=3, prompt_words=1000, max_tokens=16)
    long_prompts.start()
    started = time.monotonic()
    wait_for(lambda: roles() == ["mixed", "prefill"], 3 * INTERVAL + 20, "the decode instance did not turn mixed "
             f"under long prompts:\n{_planner_log(launch)}")
    assert time.monotonic() - started < 3 * INTERVAL + 20
    assert_same_greedy_completions(greedy(launch.url), fixed, min_share=0.75)
    assert long_prompts.end() == []

    # phase B: short prompts, 300-token answers, 16 streams (decode-bound at a 30 ms TPOT SLO)
    long_answers = Phase(launch.url, clients=16, prompt_words=30, max_tokens=300)
    long_answers.start()
    wait_for(lambda: roles() == ["decode", "mixed"], 4 * INTERVAL + 30, "the prefill instance did not turn decode "
             f"under long answers:\n{_planner_log(launch)}")
    assert_same_greedy_completions(greedy(launch.url), fixed, min_share=0.75)
    assert long_answers.end() == []

    # `pdserve planner profile` saves an instance's calibration (launch --planner calibrates them before ready)
    saved = launch.tmp / "measured.json"
    instance = next(iter(launch.instances().values()))["url"]
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "planner", "profile", "--url", instance, "--output",
                           str(saved)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    measured = DeploymentProfile.load(saved)
    assert measured.prefill_tokens_per_s > 0 and measured.itl(1) > 0 and measured.max_streams == 32

    planner_metrics = _planner_metrics(launch)
    assert total(planner_metrics, "pdserve_planner_actions_total", outcome="ok") >= 2
    assert total(planner_metrics, "pdserve_planner_actions_total", outcome="failed") == 0
    assert total(planner_metrics, "pdserve_planner_intervals_total") >= 2


def _planner_log(launch: Launch) -> str:
    return "\n".join(line for line in launch.log().splitlines() if line.startswith("[planner]"))[-4000:]


def _planner_metrics(launch: Launch) -> str:
    line = next(li for li in launch.log().splitlines() if "pdserve planner: watching" in li)
    url = line.split("metrics on ")[1].split(")")[0].split(";")[0]
    return httpx.get(url, timeout=5).text
