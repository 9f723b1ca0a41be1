"""PD TTFT with the KV cache in device memory (the staging path) against the shared-memory cache (issue 28).

    .venv/bin/python bench/device_cache.py [--prompt-len 1000] [--requests 20] [--separate-hosts]

Two 1P1D deployments (`pdserve launch --cpu-binding pin`, P on core 0, D on core 1) run side by side:
`shared`, today's CPU path (P's messager reads P's cache segment, D's receivers write D's cache), and
`staging`, the same under PDSERVE_PRIVATE_KV_CACHE=1, where every worker keeps its cache private as a
CUDA one is, P copies each layer device -> staging before it is sent and D copies staging -> device
before it decodes. Requests alternate between the two, one at a time, so the box's noise falls on
both alike; every prompt is new (no prefix-cache hits). Printed: TTFT p50 / mean per deployment and the
staging / shared ratio (the goal: within 1.10x at 1,000-token prompts). `--separate-hosts`: P and D
use tcp, as across machines, instead of ipc.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_sweep import served  # noqa: E402

from pdserve.instance.startup import PRIVATE_CACHE_ENV  # noqa: E402

FLAGS = ["--kv-cache-memory", "1G", "--max-model-len", "2048", "--max-num-batched-tokens", "512"]
WORDS = "the river runs past the old mill where the miller keeps a ledger of every sack of grain".split()


def ttft(url: str, prompt: list[int] | str, max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("the stream carried no token")


def prompts(n: int, length: int, salt: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens; the leading number makes the first block differ,
    so nothing is a prefix-cache hit."""
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_folder(None))
    body = tok.encode(" ".join(WORDS[i % len(WORDS)] for i in range(length)))
    out = []
    for i in range(n):
        head = tok.encode(f"{salt * 1000 + i}:")
        out.append((head + body)[:length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=20, help="per deployment")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--separate-hosts", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="bench-results/device_cache")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launch = [sys.executable, "-m", "pdserve.cli", "launch", "--prefill", "1", "--decode", "1", "--port", "{port}",
              "--pd-policy", "always", "--cpu-binding", "pin", "--dtype", args.dtype, *FLAGS,
              *(["--separate-hosts"] if args.separate_hosts else [])]
    envs = {"shared": {}, "staging": {PRIVATE_CACHE_ENV: "1"}}
    with ExitStack() as stack:
        urls = {k: stack.enter_context(served(k, launch, env, out / f"{k}.log")) for k, env in envs.items()}
        for k, url in urls.items():  # warm-up: first requests compile and fault memory in
            for p in prompts(3, args.prompt_len, 900 + len(k)):
                ttft(url, p, args.max_tokens)
        times: dict[str, list[float]] = {k: [] for k in urls}
        for i, (a, b) in enumerate(zip(prompts(args.requests, args.prompt_len, 1),
                                       prompts(args.requests, args.prompt_len, 2), strict=True)):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))  # neither always goes first
            for k, p in zip(order, (a, b), strict=True):
                times[k].append(ttft(urls[k], p, args.max_tokens))
    transport = "tcp" if args.separate_hosts else "ipc"
    print(f"1P1D over {transport}, {args.prompt_len}-token prompts, {args.requests} requests each, dtype {args.dtype}")
    for k, t in times.items():
        print(f"  {k:>8}: TTFT p50 {statistics.median(t) * 1000:7.1f} ms  mean {statistics.fmean(t) * 1000:7.1f} ms")
    s, g = times["shared"], times["staging"]
    print(f"staging / shared: TTFT p50 {statistics.median(g) / statistics.median(s):.3f}x, "
          f"mean {statistics.fmean(g) / statistics.fmean(s):.3f}x (goal: within 1.10x)")


if __name__ == "__main__":
    main()
