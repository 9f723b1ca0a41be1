"""Routing on cached prefixes, measured as chat users load it: ShareGPT conversations replayed turn by turn
(`pdserve bench serve --dataset sharegpt-multiturn`) against four mixed instances behind two routers on one
port, routed by cache_aware on the engines' KV events, by cache_aware on each router's memory of what it sent
(events off), and round robin; beside one instance that holds everything (the hit share to reach), and
optionally a 2P2D deployment.

    .venv/bin/python bench/kv_routing.py [--users 16] [--turns 4] [--think-time 1] [--max-tokens 128]
        [--deployments one,events,approximate,round_robin] [--out bench-results/kv_routing]

Prints, per deployment: TTFT p50 of turns 2+, their prefix hit share (cached prompt tokens as the answers'
usage reports them: in PD, the decode instance's), each role's own prefix-cache hit share over all turns
(its /metrics), goodput under --goodput, and the ratios the issue sets (hit share against one instance's,
TTFT p50 against round robin's and the approximate policy's, goodput against the approximate policy's).
Every deployment gets the same conversations (same seed), each on fresh instances.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from pd_sweep import served

FLAGS = ["--kv-cache-memory", "1G", "--max-model-len", "4096"]
ROUTED = ["--routers", "2", "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware"]
NO_EVENTS = ["--kv-events-config", '{"publisher": "null"}']
LEAST_LOAD = ["--prefill-policy", "least_tokens", "--decode-policy", "least_requests"]  # launch's default until stop 50


def commands() -> dict[str, list[str]]:
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    mixed4 = [*pdserve, "launch", "--mixed", "4", "--port", "{port}", *FLAGS]
    return {
        "one": [*pdserve, "serve", "--port", "{port}", "--kv-cache-memory", "4G", "--max-model-len", "4096"],
        "events": [*mixed4, *ROUTED],
        "approximate": [*mixed4, *ROUTED, *NO_EVENTS],
        "events_dynamo": [*mixed4, *ROUTED, "--kv-decode-load-weight", "1.0"],
        "round_robin": [*mixed4, "--routers", "2", "--prefill-policy", "round_robin", "--decode-policy",
                        "round_robin"],
        "2p2d": [*pdserve, "launch", "--prefill", "2", "--decode", "2", "--port", "{port}", *FLAGS, *ROUTED,
                 "--pd-policy", "always"],
        "least_load": [*mixed4, "--routers", "2", *LEAST_LOAD],
        "2p2d_least_load": [*pdserve, "launch", "--prefill", "2", "--decode", "2", "--port", "{port}", *FLAGS,
                            "--routers", "2", *LEAST_LOAD, "--pd-policy", "always"],
    }


NAMES = {"one": "one mixed instance (holds everything)", "events": "4 mixed, cache_aware on KV events",
         "approximate": "4 mixed, cache_aware approximate",
         "events_dynamo": "4 mixed, cache_aware on KV events, decoding blocks weighed 1.0 (Dynamo)",
         "round_robin": "4 mixed, round robin",
         "2p2d": "2P2D, cache_aware on KV events",
         "least_load": "4 mixed, least_tokens / least_requests",
         "2p2d_least_load": "2P2D, least_tokens / least_requests"}


def engine_hits(url: str) -> dict[str, tuple[float, float]]:
    """Each registered instance's prefix cache (hit tokens, queried tokens), by role (a single server: 'mixed')."""
    try:
        instances = httpx.get(f"{url}/registered", timeout=10).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        instances = [{"role": "mixed", "host": "127.0.0.1", "metrics_port": None, "url": url}]
    out: dict[str, tuple[float, float]] = {}
    for i in instances:
        text = httpx.get(f"http://{i['host']}:{i['metrics_port']}/metrics" if i["metrics_port"] else f"{url}/metrics",
                         timeout=10).text
        hits, queried = (sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith(name)) for name in ("pdserve_prefix_cache_hits_total",
                                                                     "pdserve_prefix_cache_queries_total"))
        h, q = out.get(i["role"], (0.0, 0.0))
        out[i["role"]] = (h + hits, q + queried)
    return out


def measure(name: str, args: argparse.Namespace, out: Path) -> dict:
    result = out.with_name(f"{out.name}-{name}.json")
    with served(name, commands()[name], {}, out.with_name(f"{out.name}-{name}.log")) as url:
        before = engine_hits(url)
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--dataset",
                        "sharegpt-multiturn", "--num-users", str(args.users), "--max-turns", str(args.turns),
                        "--think-time", str(args.think_time), "--sharegpt-output-len", str(args.max_tokens),
                        "--max-context", "4096", "--temperature", args.temperature, "--seed", str(args.seed),
                        "--goodput", *args.goodput, "--save-result", str(result), "--no-progress"], check=True)
        time.sleep(1.5)  # instances refresh their metrics once a second
        after = engine_hits(url)
    saved = json.loads(result.read_text())
    saved["engine_hit_share"] = {role: (h - before.get(role, (0, 0))[0]) / max(q - before.get(role, (0, 0))[1], 1)
                                 for role, (h, q) in after.items()}
    return saved


def row(name: str, result: dict) -> dict:
    later = result["later_turns"]
    return {"name": name, "ttft_p50": later["ttft_p50_ms"], "hit_share": later["hit_share"],
            "goodput": result["summary"]["goodput"], "failed": result["summary"]["failed"],
            "engines": result["engine_hit_share"]}


def report(rows: dict[str, dict]) -> str:
    lines = ["| deployment | TTFT p50, turns 2+ (ms) | prefix hit share, turns 2+ | engines' hit share, all turns | "
             "goodput (req/s) | failed |", "|---|---|---|---|---|---|"]
    for key, r in rows.items():
        engines = ", ".join(f"{role} {share:.1%}" for role, share in sorted(r["engines"].items()))
        lines.append(f"| {NAMES[key]} | {r['ttft_p50']:.0f} | {r['hit_share']:.1%} | {engines} | {r['goodput']:.3f} | "
                     f"{r['failed']} |")
    ratio = []
    ev, ap, rr, one = (rows.get(k) for k in ("events", "approximate", "round_robin", "one"))
    if ev and one:
        ratio.append(f"hit share, events / one instance: {ev['hit_share'] / max(one['hit_share'], 1e-9):.2f} "
                     "(goal >= 0.90)")
    if ev and rr:
        ratio.append(f"TTFT p50 turns 2+, events / round robin: {ev['ttft_p50'] / rr['ttft_p50']:.2f} (goal <= 0.5)")
    if ev and ap:
        ratio.append(f"TTFT p50 turns 2+, events / approximate: {ev['ttft_p50'] / ap['ttft_p50']:.2f} (goal <= 0.8)")
        ratio.append(f"goodput, events / approximate: {ev['goodput'] / max(ap['goodput'], 1e-9):.2f} (goal >= 1.2)")
    for cache, least in (("events", "least_load"), ("2p2d", "2p2d_least_load")):
        if rows.get(cache) and rows.get(least):
            ratio.append(f"TTFT p50 turns 2+, {NAMES[cache]} / {NAMES[least]}: "
                         f"{rows[cache]['ttft_p50'] / rows[least]['ttft_p50']:.2f}; hit share "
                         f"{rows[cache]['hit_share']:.1%} / {rows[least]['hit_share']:.1%}; goodput "
                         f"{rows[cache]['goodput'] / max(rows[least]['goodput'], 1e-9):.2f}x")
    if rows.get("2p2d") and one:
        ratio.append(f"hit share, 2P2D / one instance: {rows['2p2d']['hit_share'] / max(one['hit_share'], 1e-9):.2f}")
    return "\n".join(lines + [""] + ratio)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=128, help="each answer's length (the same for every deployment)")
    p.add_argument("--temperature", default="0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"])
    p.add_argument("--deployments", default="one,events,approximate,round_robin")
    p.add_argument("--out", type=Path, default=Path("bench-results/kv_routing"))
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.deployments.split(","):
        rows[name] = row(name, measure(name, args, args.out))
        print(f"{NAMES[name]}: {rows[name]}", flush=True)
    text = report(rows)
    print(text)
    args.out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
