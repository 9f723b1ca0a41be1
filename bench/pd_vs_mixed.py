"""One mixed instance against 1P1D on the same two cores, under a prefill-heavy mixed workload.

    .venv/bin/python bench/pd_vs_mixed.py [--seconds 60] [--decoders 8] [--long-every 4.0]

Both deployments sit behind a router. Mixed: one instance on both cores. PD: the prefill instance
pinned to core 0 and the decode instance to core 1 (taskset, one torch thread each), KV over ipc.
Workload: `--decoders` clients loop short-prompt, long-answer requests (the decodes we watch) while
a long prompt (prefill-heavy, few new tokens) arrives every `--long-every` seconds. Reported: the
decodes' inter-token latency p50/p99 (gaps between streamed tokens), their TTFT, and the output
tokens per second of everything, for both, with PD/mixed ratios. In a mixed instance each long
prefill chunk lands in the decodes' steps and stretches their token gaps; in PD it cannot.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time

import httpx

from pdserve.api.serve import free_port

FLAGS = ["--kv-cache-memory", "2G", "--max-model-len", "2048", "--max-num-batched-tokens", "512"]
WORDS = "the river runs past the old mill where the miller keeps a ledger of every sack of grain".split()


def _start(cmd: list[str], cpus: str | None, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    prefix = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    return subprocess.Popen([*prefix, sys.executable, "-m", "pdserve.cli", *cmd], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def deploy(kind: str) -> tuple[str, list[subprocess.Popen]]:
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    procs = [_start(["router", "--port", str(port)], None, 1)]
    reg = ["--router", router]
    if kind == "mixed":
        procs.append(_start(["serve", "--port", str(free_port()), *FLAGS, *reg], "0,1", 2))
    else:
        procs.append(_start(["serve", "--splitwise-role", "prefill", "--port", str(free_port()), *FLAGS, *reg],
                            "0", 1))
        procs.append(_start(["serve", "--splitwise-role", "decode", "--port", str(free_port()), *FLAGS, *reg],
                            "1", 1))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{router}/health", timeout=2).status_code == 200:
                return router, procs
        except httpx.HTTPError:
            pass
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(1)
    stop(procs)
    raise SystemExit(f"the {kind} deployment did not come up")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, gaps between tokens, tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    if not stamps:
        return float("nan"), [], 0
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], len(stamps)


async def workload(url: str, seconds: float, decoders: int, long_every: float) -> dict:
    short = " ".join(WORDS[:12])
    long = " ".join(WORDS[i % len(WORDS)] for i in range(1000))
    gaps: list[float] = []
    ttfts: list[float] = []
    tokens = 0
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def decoder() -> None:
            nonlocal tokens
            while time.perf_counter() < end:
                ttft, g, n = await stream(client, short, 128)
                gaps.extend(g)
                ttfts.append(ttft)
                tokens += n

        async def prefills() -> None:
            nonlocal tokens
            tasks = []
            i = 0
            while time.perf_counter() < end:
                i += 1
                tasks.append(asyncio.create_task(stream(client, f"{i} {long}", 8)))
                await asyncio.sleep(long_every)
            for _, _, n in await asyncio.gather(*tasks):
                tokens += n

        start = time.perf_counter()
        await asyncio.gather(prefills(), *(decoder() for _ in range(decoders)))
        wall = time.perf_counter() - start
    q = statistics.quantiles(gaps, n=100)
    return {"itl_p50": q[49] * 1000, "itl_p99": q[98] * 1000, "ttft_p50": statistics.median(ttfts) * 1000,
            "tok_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--long-every", type=float, default=4.0)
    args = parser.parse_args()
    results = {}
    for kind in ("mixed", "pd"):
        url, procs = deploy(kind)
        try:
            asyncio.run(workload(url, 5, 2, 10))  # warm up
            results[kind] = asyncio.run(workload(url, args.seconds, args.decoders, args.long_every))
        finally:
            stop(procs)
        print(f"{kind:>5}: " + "  ".join(f"{k} {v:8.1f}" for k, v in results[kind].items()), flush=True)
    m, p = results["mixed"], results["pd"]
    print(f"\nPD / mixed: ITL p50 {p['itl_p50'] / m['itl_p50']:.2f}x, ITL p99 {p['itl_p99'] / m['itl_p99']:.2f}x "
          f"(lower is better), decode TTFT p50 {p['ttft_p50'] / m['ttft_p50']:.2f}x, "
          f"throughput {p['tok_s'] / m['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
