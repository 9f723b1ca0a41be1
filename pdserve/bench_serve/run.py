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

from pdserve.bench_serve import tiers
from pdserve.bench_serve.client import RequestRecord, request_body, send
from pdserve.bench_serve.datasets import BenchRequest, jsonl_requests, random_requests
from pdserve.bench_serve.find_rate import Probe, find_rate, format_probes, plot_probes
from pdserve.bench_serve.report import format_table, plot, save_probes, save_result
from pdserve.bench_serve.sharegpt import sharegpt_requests
from pdserve.bench_serve.summary import parse_slos, summarize
from pdserve.bench_serve.tiers import TierCounters


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
        percentiles = sorted(float(p) for p in args.metric_percentiles.split(",") if p.strip())
        slos = parse_slos(args.goodput)
        rate = float(args.request_rate)
        if args.find_rate and not slos:
            raise ValueError("--find-rate needs the SLOs: --goodput ttft:MS tpot:MS e2el:MS")
        requests = _load(args, args.seed) if args.dataset[0] != "sharegpt-multiturn" else []
    except (ValueError, OSError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    model = args.model or _first_model(base)
    if args.dataset[0] == "sharegpt-multiturn":
        return _multiturn(base, model, args, percentiles, slos)
    path = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    if args.find_rate:
        return _find_rate(base, path, model, args, percentiles, slos)
    before = _tiers_now(args)
    records, duration = asyncio.run(_run(base, path, requests, model, args, rate))
    summary = summarize(records, duration, percentiles, slos)
    print(format_table(summary), flush=True)
    by_tier = _tiers_since(args, before)
    if args.save_result:
        save_result(args.save_result, summary, records, _config(args), **by_tier)
    if args.plot:
        plot(args.plot, records)
    return 0 if summary.completed else 1


def _find_rate(base: str, path: str, model: str | None, args: argparse.Namespace, percentiles: list[float],
               slos: dict[str, float]) -> int:
    """Each probe sends other prompts (seed + probe number): the same ones again would hit the prefix cache."""
    runs: list[dict] = []

    def measure(rate: float) -> Probe:
        requests = _load(args, args.seed + len(runs))
        records, duration = asyncio.run(_run(base, path, requests, model, args, rate))
        summary = summarize(records, duration, percentiles, slos)
        print(f"rate {rate:.3f} req/s: {summary.slo_attainment:.1%} met the SLOs, goodput {summary.goodput:.3f} "
              f"req/s, {summary.failed} failed", flush=True)
        runs.append({"rate": rate, "summary": summary, "records": records})
        return Probe(rate, summary.slo_attainment or 0.0, summary.goodput or 0.0)

    best, probes = find_rate(measure, args.find_rate_start, args.slo_attainment, args.find_rate_steps,
                             args.find_rate_max)
    print(format_probes(probes, best, args.slo_attainment), flush=True)
    if args.save_result:
        save_probes(args.save_result, runs, best, args.slo_attainment, _config(args))
    if args.plot:
        plot_probes(args.plot, probes, best, args.slo_attainment)
    return 0 if best is not None else 1


def _multiturn(base: str, model: str | None, args: argparse.Namespace, percentiles: list[float],
               slos: dict[str, float]) -> int:
    from pdserve.bench_serve import multiturn
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    if args.find_rate or len(args.dataset) > 2:
        print("pdserve bench: sharegpt-multiturn takes an optional PATH and no --find-rate (its load is "
              "--num-users)", file=sys.stderr)
        return 2
    try:
        conversations = multiturn.sharegpt_conversations(
            Path(args.dataset[1]) if len(args.dataset) == 2 else None, args.num_users,
            Tokenizer(resolve_model_folder(args.tokenizer)), args.seed, args.max_turns, args.sharegpt_output_len)
    except (ValueError, OSError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    before = _tiers_now(args)
    records, duration = asyncio.run(multiturn.run_users(base, conversations, model, args.think_time,
                                                        args.temperature, args.seed, args.max_context,
                                                        not args.no_progress))
    summary = summarize(records, duration, percentiles, slos)
    turns, later = multiturn.by_turn(records), multiturn.later_turns(records)
    print(format_table(summary), flush=True)
    print(multiturn.format_turns(turns, later), flush=True)
    by_tier = _tiers_since(args, before)
    if args.save_result:
        save_result(args.save_result, summary, records, _config(args),
                    by_turn=[{**vars(t), "hit_share": t.hit_share} for t in turns],
                    later_turns={**vars(later), "hit_share": later.hit_share}, **by_tier)
    if args.plot:
        multiturn.plot_turns(args.plot, turns)
    return 0 if summary.completed else 1


def _tiers_now(args: argparse.Namespace) -> TierCounters | None:
    return tiers.scrape(args.metrics_url) if args.metrics_url else None


def _tiers_since(args: argparse.Namespace, before: TierCounters | None) -> dict:
    """The run's prefix hits by tier (--metrics-url), printed; {"tiers": ...} for the saved result, or {}."""
    if before is None:
        return {}
    time.sleep(1.2)  # an instance's metrics port refreshes its engine figures every second
    run = tiers.scrape(args.metrics_url)
    run.add(before, -1.0)
    print(tiers.format_tiers(run), flush=True)
    return {"tiers": {"hit_tokens": run.hit_tokens, "wait_seconds": run.wait_seconds,
                      "queried_tokens": run.queried_tokens, "prefill_rate": run.prefill_rate,
                      "saved_seconds": {t: run.saved_seconds(t) for t in tiers.TIERS}}}


def _config(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k not in ("command", "instance_args")}


def _load(args: argparse.Namespace, seed: int) -> list[BenchRequest]:
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_folder(args.tokenizer))
    kind = args.dataset[0]
    if kind == "random":
        reqs = random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, seed)
        if args.backend == "openai-chat":  # chat takes text: the ids' text (its length is then approximate)
            for r in reqs:
                r.messages = [{"role": "user", "content": tokenizer.decode(r.prompt)}]
        return reqs
    if kind == "sharegpt" and len(args.dataset) <= 2:
        path = Path(args.dataset[1]) if len(args.dataset) == 2 else None
        return sharegpt_requests(path, args.num_prompts, tokenizer, seed, args.sharegpt_output_len,
                                 chat=args.backend == "openai-chat")
    if kind == "jsonl" and len(args.dataset) == 2:
        return jsonl_requests(Path(args.dataset[1]), args.num_prompts, args.random_output_len, seed, tokenizer)
    raise ValueError("--dataset takes `random`, `sharegpt [PATH]` or `jsonl PATH`")


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
            body = request_body(req, args.backend, model, args.ignore_eos, args.temperature)
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
