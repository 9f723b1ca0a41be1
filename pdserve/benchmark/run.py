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


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (or router) to measure")
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="HF folder or .gguf whose tokenizer makes the random prompts (default: the embedded model)")
    p.add_argument("--dataset", nargs="+", default=["random"], metavar="random|jsonl PATH",
                   help="random, or jsonl PATH (one {\"messages\": [...]} or {\"prompt\": ...} per line)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", default="inf", help="requests per second (Poisson arrivals), or inf")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--random-input-len", type=int, default=512)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=None, metavar="SLO", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--metric-percentiles", default="80,95,99,99.9,99.95,99.99")
    p.add_argument("--save-result", type=Path, default=None, help="write every request and the summary as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG: TTFT and ITL histograms, tokens/s")
    p.add_argument("--no-progress", action="store_true")


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
