"""What the HTTP path costs: the same requests offline (LLM) and through `pdserve serve`, one run.

    .venv/bin/python bench/serving_overhead.py [--requests 64] [--prompt-len 128] [--new-tokens 128]

All requests are in flight at once in both cases (the server sees --requests concurrent streaming
clients). The figure is generated tokens per second of wall time; the goal is HTTP >= 90% of offline.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import httpx
import torch

ENGINE_FLAGS = {"kv_cache_memory": 4 << 30, "max_model_len": 1024, "enable_prefix_caching": False}


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 49152, (length,), generator=g).tolist() for _ in range(n)]


def offline(batch: list[list[int]], new_tokens: int) -> float:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    with LLM(**ENGINE_FLAGS) as llm:
        llm.generate([{"prompt_token_ids": p} for p in batch[:4]], params, use_tqdm=False)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return len(batch) * new_tokens / (time.perf_counter() - t)


async def _http_run(base: str, batch: list[list[int]], new_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def one(p: list[int]) -> int:
            body = {"prompt_token_ids": p, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            tokens = 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage": {' in line:
                        tokens = int(line.split('"completion_tokens": ')[1].split(",")[0])
            return tokens

        await asyncio.gather(*(one(p) for p in batch[:4]))
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in batch))
        elapsed = time.perf_counter() - t
    assert all(c == new_tokens for c in counts), counts
    return len(batch) * new_tokens / elapsed


def http(batch: list[list[int]], new_tokens: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--kv-cache-memory", "4G",
           "--max-model-len", str(ENGINE_FLAGS["max_model_len"]), "--no-enable-prefix-caching"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError("the server exited during start-up")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy")
            time.sleep(0.5)
        return asyncio.run(_http_run(base, batch, new_tokens))
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    batch = prompts(args.requests, args.prompt_len)
    off = offline(batch, args.new_tokens)
    over_http = http(batch, args.new_tokens)
    print(f"\n{args.requests} concurrent requests x {args.prompt_len} -> {args.new_tokens} tokens, greedy, fp32")
    print(f"  offline LLM.generate   {off:8.1f} generated tok/s")
    print(f"  HTTP (pdserve serve)   {over_http:8.1f} generated tok/s   = {over_http / off:.0%} of offline")


if __name__ == "__main__":
    main()
