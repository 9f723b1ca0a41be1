"""`pdserve bench serve`: drive a server with a workload and report the seed 003 table."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from pdserve.benchmark.client import RequestRecord, request_body, send
from pdserve.benchmark.datasets import BenchRequest, jsonl_requests, random_requests
from pdserve.benchmark.report import format_table, plot, save_result
from pdserve.benchmark.summary import parse_slos, summarize


def bench_serve(args: argparse.Namespace) -> int:
    base = args.base_url.rstrip("/")
    try:
        health = httpx.get(f"{base}/health", timeout=10)
    except httpx.HTTPError as e:
        print(f"pdserve bench: the server at {base} is not reachable: {e}", file=sys.stderr)
        return 1
    if health.status_code != 200:
        print(f"pdserve bench: the server at {base} is not healthy (/health answered {health.status_code})",
              file=sys.stderr)
        return 1
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        slos = parse_slos(args.goodput)
        rate = float(args.request_rate)
        requests = _load(args)
    except (ValueError, OSError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    model = args.model or _first_model(base)
    path = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    records, duration = asyncio.run(_run(base, path, requests, model, args, rate))
    summary = summarize(records, duration, sorted(percentiles), slos)
    print(format_table(summary), flush=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("command", "instance_args")}
    if args.save_result:
        save_result(args.save_result, summary, records, config)
    if args.plot:
        plot(args.plot, records)
    return 0 if summary.completed else 1


def _load(args: argparse.Namespace) -> list[BenchRequest]:
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_folder(args.tokenizer))
    kind = args.dataset[0]
    if kind == "random":
        reqs = random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
        if args.backend == "openai-chat":  # chat takes text: the ids' text (its length is then approximate)
            for r in reqs:
                r.messages = [{"role": "user", "content": tokenizer.decode(r.prompt)}]
        return reqs
    if kind == "jsonl" and len(args.dataset) == 2:
        return jsonl_requests(Path(args.dataset[1]), args.num_prompts, args.random_output_len, args.seed, tokenizer)
    raise ValueError("--dataset takes `random` or `jsonl PATH`")


def _first_model(base: str) -> str | None:
    try:
        return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


async def _run(base: str, path: str, requests: list[BenchRequest], model: str | None, args: argparse.Namespace,
               rate: float) -> tuple[list[RequestRecord], float]:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(requests), disable=args.no_progress, desc="requests", file=sys.stderr)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        async def one(req: BenchRequest) -> RequestRecord:
            body = request_body(req, args.backend, model, args.ignore_eos)
            if limit is None:
                rec = await send(client, path, body, req.prompt_len)
            else:
                async with limit:
                    rec = await send(client, path, body, req.prompt_len)
            bar.update(1)
            return rec

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if rate != float("inf"):
                # gamma(shape=burstiness, scale=1/(rate*burstiness)): mean gap 1/rate; 1 = exponential
                await asyncio.sleep(rng.gammavariate(args.burstiness, 1 / (rate * args.burstiness)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(records), duration
