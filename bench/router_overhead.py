"""What the router adds: latency per request in front of a real instance, and its ceiling in requests/s.

    .venv/bin/python bench/router_overhead.py [--requests 200] [--seconds 10] [--concurrency 32]

1. Latency: the same short completion (4 tokens, greedy) straight to a mixed instance and through
   the router to it, alternating one by one so both see the same machine noise; prints p50/p99 of
   each and what the router adds (goal: < 2 ms at p50). The instance's own spread (tens of ms) hides
   a millisecond, so the same is measured again against the stub below, one request at a time.
2. Ceiling: the router in front of a stub instance that answers at once (a raw ASGI app), loaded by
   --concurrency keep-alive clients for --seconds; the stub alone is measured the same way, and the
   ratio is the router's share. On a 2-core box the load generator, the router and the stub share the
   cores, so both figures are lower bounds of what each would do on its own cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BODY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], ready_url: str, timeout: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(args)} exited with {proc.returncode}")
        try:
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{' '.join(args)} was not ready in {timeout} s")


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


# ---- 1. latency in front of a real instance ----------------------------------------------------

def compare(direct_url: str, router_url: str, requests: int, body: dict) -> tuple[list[float], list[float]]:
    """Alternating requests, one at a time: (direct ms, routed ms)."""
    direct, routed = [], []
    with httpx.Client(timeout=60) as client:
        for url in (direct_url, router_url):
            for _ in range(5):  # warm both paths
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
        for _ in range(requests):
            for url, out in ((direct_url, direct), (router_url, routed)):
                t = time.perf_counter()
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
                out.append((time.perf_counter() - t) * 1000)
    return direct, routed


def report(title: str, direct: list[float], routed: list[float]) -> None:
    print(f"\n{title} (ms)")
    print(f"{'':10}{'p50':>10}{'p99':>10}{'mean':>10}")
    for name, values in (("direct", direct), ("router", routed)):
        print(f"{name:10}{pct(values, 50):10.2f}{pct(values, 99):10.2f}{statistics.fmean(values):10.2f}")
    print(f"{'added':10}{pct(routed, 50) - pct(direct, 50):10.2f}{pct(routed, 99) - pct(direct, 99):10.2f}"
          f"{statistics.fmean(routed) - statistics.fmean(direct):10.2f}"
          f"   (router/direct p50 {pct(routed, 50) / pct(direct, 50):.3f}x; goal: added p50 < 2 ms)")


def latency(requests: int) -> None:
    inst_port, router_port = free_port(), free_port()
    router = start(["-m", "pdserve.cli", "router", "--port", str(router_port), "--tokenizer", "none"],
                   f"http://127.0.0.1:{router_port}/registered")
    instance = start(["-m", "pdserve.cli", "serve", "--port", str(inst_port), "--router",
                      f"http://127.0.0.1:{router_port}", "--kv-cache-memory", "2G", "--max-model-len", "1024"],
                     f"http://127.0.0.1:{router_port}/health")
    try:
        direct, routed = compare(f"http://127.0.0.1:{inst_port}", f"http://127.0.0.1:{router_port}", requests, BODY)
    finally:
        stop(instance, router)
    report(f"1. a 4-token completion from a mixed instance, {requests} requests each way", direct, routed)


# ---- 2. ceiling against a stub -----------------------------------------------------------------

COMPLETION = json.dumps({"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                         "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}]}).encode()


async def stub_app(scope: dict, receive, send) -> None:  # noqa: ANN001 - raw ASGI
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = COMPLETION if scope["method"] == "POST" else b""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _load(port: int, seconds: float, concurrency: int) -> float:
    payload = json.dumps(BODY).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    done = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:  # a keep-alive HTTP/1.1 client with no parsing beyond Content-Length
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < deadline:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"bad answer: {head[:200]!r}")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            done += 1
        writer.close()

    start_t = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - start_t)


def ceiling(seconds: float, concurrency: int) -> None:
    stub_port, router_port = free_port(), free_port()
    stub = start(["-m", "uvicorn", "bench.router_overhead:stub_app", "--port", str(stub_port), "--log-level",
                  "warning", "--no-access-log"], f"http://127.0.0.1:{stub_port}/health")
    listing = Path(tempfile.mkdtemp()) / "instances.yaml"
    listing.write_text(json.dumps({"instances": [{"role": "mixed", "url": f"http://127.0.0.1:{stub_port}"}]}))
    router = start(["-m", "pdserve.cli", "router", "--port", str(router_port), "--instances", str(listing),
                    "--tokenizer", "none"], f"http://127.0.0.1:{router_port}/health")
    try:
        direct, routed = compare(f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{router_port}", 500, BODY)
        report("1b. the same against the stub, 500 requests each way", direct, routed)
        asyncio.run(_load(stub_port, 1, concurrency))  # warm up
        alone = asyncio.run(_load(stub_port, seconds, concurrency))
        asyncio.run(_load(router_port, 1, concurrency))
        routed = asyncio.run(_load(router_port, seconds, concurrency))
    finally:
        stop(router, stub)
    print(f"\n2. requests/s with {concurrency} keep-alive clients for {seconds:g} s (all on {os.cpu_count()} cores)")
    print(f"stub alone        {alone:10.0f}")
    print(f"router -> stub    {routed:10.0f}   (router/stub {routed / alone:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    latency(args.requests)
    ceiling(args.seconds, args.concurrency)


if __name__ == "__main__":
    main()
