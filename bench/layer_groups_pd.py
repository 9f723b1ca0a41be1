"""Gemma 3 in PD with a block table per layer group against one table for every layer (vLLM's
`--disable-hybrid-kv-cache-manager`), through `pdserve launch --prefill 1 --decode 1` as users start it.

    .venv/bin/python bench/layer_groups_pd.py [--rounds 2] [--requests 4] [--prompt-tokens 4000] [--max-tokens 32]
        [--launch-args="--kv-events-config {...}"]

Each deployment gets the same distinct long prompts (random token ids: nothing is cached), one at a time, streamed.
Reported per request: the KV bytes P wrote into D (D's `pdserve_kv_transfer_bytes_received_total`), the time to the
first token through the router, and the decode TPOT; then the grouped figure over the one-table figure. With groups
P sends a sliding layer only the window D decodes from (Gemma 3 270M: 3 of 18 layers global, the other 15 see 512
tokens), so a 4k-token prompt moves ~0.3x the bytes.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdserve.api.serve import free_port

BYTES = "pdserve_kv_transfer_bytes_received_total"


def launch(extra: list[str], max_len: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "launch", "--port", str(port), "--model", "gemma-3-270m",
           "--prefill", "1", "--decode", "1", "--routers", "1", "--pd-policy", "always", "--max-model-len",
           str(max_len), *extra]
    log = tempfile.NamedTemporaryFile("w+", prefix="layer-groups-pd-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while "ready on" not in Path(log.name).read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"launch {' '.join(extra)} was not ready; its log: {log.name}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def received(decode: str) -> float:
    url = urlsplit(decode)
    text = httpx.get(f"{url.scheme}://{url.netloc}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(BYTES))


def one(router: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT s, TPOT ms) of one streamed completion."""
    body = {"model": "gemma-3-270m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times[0] - start, (times[-1] - times[0]) / max(1, len(times) - 1) * 1000


def measure(extra: list[str], prompts: list[list[int]], args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """(KV MB, TTFT s, TPOT ms) of each prompt."""
    proc, router = launch(extra, args.prompt_tokens + args.max_tokens + 64)
    try:
        (decode,) = [i["url"] for i in httpx.get(f"{router}/registered", timeout=10).json()["instances"]
                     if i["role"] == "decode"]
        one(router, [5] * 64, 4)  # warm up both instances
        before = received(decode)
        times = [one(router, p, args.max_tokens) for p in prompts]
        time.sleep(1.5)  # the counters are read from the engine once a second at most
        mb = (received(decode) - before) / len(prompts) / 1e6
        return [(mb, ttft, tpot) for ttft, tpot in times]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="deployments of each kind, in the order ABBA...")
    parser.add_argument("--launch-args", default="", help="more `pdserve launch` flags for both deployments")
    args = parser.parse_args()
    rng = random.Random(0)
    modes = {"layer groups": [], "one table": ["--disable-hybrid-kv-cache-manager"]}
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in modes}
    order = [name for r in range(args.rounds) for name in (modes if r % 2 == 0 else reversed(modes))]  # ABBA...
    for name in order:
        prompts = [[2] + [rng.randrange(1000, 200_000) for _ in range(args.prompt_tokens - 1)]
                   for _ in range(args.requests)]  # distinct for each run too: no prefix-cache hit anywhere
        runs[name] += measure([*modes[name], *shlex.split(args.launch_args)], prompts, args)
    print(f"Gemma 3 270M, pdserve launch 1P1D, {args.rounds} deployments of each kind (ABBA), {args.requests} prompts "
          f"of {args.prompt_tokens} tokens each, {args.max_tokens} new tokens, one at a time\n")
    print("| figure | layer groups | one table | groups / one table |\n|---|---|---|---|")
    for i, key in enumerate(("KV bytes per request (MB)", "TTFT p50 (s)", "TPOT p50 (ms)")):
        a, b = (statistics.median(r[i] for r in runs[name]) for name in modes)
        print(f"| {key} | {a:.3g} | {b:.3g} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
