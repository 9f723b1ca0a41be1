"""What a JSON schema costs a served request: TPOT and output throughput, constrained against
unconstrained, at batch 1, 16 and 64, and the compile time of a schema.

    .venv/bin/python bench/structured.py [--batches 1,16,64] [--max-tokens 64]

One `pdserve serve` (mixed); each batch is that many concurrent streaming chat requests of the same
prompts, `max_tokens` tokens each (ignore_eos, so both runs generate the same number of tokens; the
schema is long enough that no answer completes it), unconstrained and with the schema taking turns
`--rounds` times (this box's speed drifts by 1.5x within minutes): the medians and the median of the
rounds' ratios are printed. TPOT of a request is (last token - first token) / (tokens - 1), timed by
the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx

from pdserve.api.serve import free_port

SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 40, "maxItems": 40, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"type": "string", "enum": ["fruit", "tool", "animal"]}},
        "required": ["name", "count", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
TOPICS = ["a farm", "a workshop", "a zoo", "a market", "a kitchen", "a garden", "a harbour", "a school"]


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    body: dict = {"messages": [{"role": "user", "content": f"List the things in {TOPICS[i % len(TOPICS)]} as JSON."}],
                  "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "things", "schema": SCHEMA}}
    stamps = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                if delta and delta[0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    return ((stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0), len(stamps)


async def batch(url: str, size: int, max_tokens: int, constrained: bool) -> tuple[float, float]:
    """(TPOT p50 in ms, output tokens/s) of `size` concurrent requests."""
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, i, max_tokens, constrained) for i in range(size)))
        wall = time.perf_counter() - t0
    return statistics.median(r[0] for r in results) * 1000, size * max_tokens / wall


def compile_times() -> dict[str, float]:
    from llguidance import LLMatcher, LLTokenizer

    from pdserve.loader import resolve_model_folder
    from pdserve.structured.spec import grammar_of, json_schema

    folder = resolve_model_folder(None)
    t0 = time.perf_counter()
    tokenizer = LLTokenizer((folder / "tokenizer.json").read_text(), eos_token=2)
    out = {"tokenizer (once per worker)": time.perf_counter() - t0}
    t0 = time.perf_counter()
    matcher = LLMatcher(tokenizer, grammar_of(json_schema(SCHEMA)), log_level=0)
    out["bench schema, first use"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher.deep_copy()
    out["bench schema, cached (a copy)"] = time.perf_counter() - t0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for what, seconds in compile_times().items():
        print(f"compile: {what}: {seconds * 1000:.2f} ms")
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--kv-cache-memory",
                             "3G", "--max-model-len", "2048", "--max-num-seqs", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        asyncio.run(batch(url, 2, 8, True))  # warm-up: the worker's grammar tokenizer is built here
        print(f"\n{'batch':>5} | {'TPOT plain ms':>13} | {'TPOT schema ms':>14} | {'ratio':>5} | "
              f"{'tok/s plain':>11} | {'tok/s schema':>12} | ratio | TPOT ratio per round")
        for size in (int(b) for b in args.batches.split(",")):
            plain, schema = [], []
            for _ in range(args.rounds):
                plain.append(asyncio.run(batch(url, size, args.max_tokens, False)))
                schema.append(asyncio.run(batch(url, size, args.max_tokens, True)))
            ratios = [s[0] / p[0] for p, s in zip(plain, schema, strict=True)]
            tps_ratios = [s[1] / p[1] for p, s in zip(plain, schema, strict=True)]

            def med(runs: list, i: int) -> float:
                return statistics.median(r[i] for r in runs)

            print(f"{size:>5} | {med(plain, 0):>13.1f} | {med(schema, 0):>14.1f} | {statistics.median(ratios):>5.2f} | "
                  f"{med(plain, 1):>11.1f} | {med(schema, 1):>12.1f} | {statistics.median(tps_ratios):.2f}  | "
                  + " ".join(f"{r:.2f}" for r in ratios))
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
