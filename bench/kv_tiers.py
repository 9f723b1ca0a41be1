"""KV beyond one instance's memory: multi-turn ShareGPT conversations across mixed instances behind a router that
spreads them, one instance stopped and started again mid-run, without and with the disk tier and prefix pulls.

    .venv/bin/python bench/kv_tiers.py [--instances 4] [--users 8] [--turns 6] [--output-len 32]
        [--restart-at 0.4] [--policy round_robin] [--out bench-results/kv_tiers]

Per configuration, on this machine: a `pdserve router --decode-policy round_robin` and --instances mixed
`pdserve serve` instances registered with it, each with a host tier (--swap-space); the second configuration adds
`--kv-disk-path` (one folder per instance) and `--enable-kv-pull`. The users of `pdserve bench serve --dataset
sharegpt-multiturn` (pdserve/bench_serve/multiturn.py) replay ShareGPT conversations against the router, every
turn the whole history. Once --restart-at of the turns are done, instance 1 is stopped (SIGTERM: a clean stop)
and started again on the same ports and folder.

Prints, per configuration: later turns' TTFT p50/p90 (all, and those whose prompt reaches 1,000 tokens), the
share of their prompt tokens served by each tier (device, host, disk, pulled from a peer: the instances'
`pdserve_prefix_cache_hits_by_tier_total`), the prefill time each tier saved (its tokens at the instances'
measured prefill rate, less the engine's wait for its copies), and the restarted instance's hit share before
the stop and on its first requests after it; then the ratios of the two configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from pdserve.api.serve import free_port
from pdserve.bench_serve import multiturn, tiers
from pdserve.bench_serve.tiers import TierCounters
from pdserve.loader import resolve_model_folder
from pdserve.tokenization.tokenizer import Tokenizer

LONG_PREFIX = 1000  # tokens: the goal is for later turns whose prompt reaches this


@dataclass
class Instance:
    index: int
    port: int
    metrics_port: int
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "pdserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--metrics-port", str(self.metrics_port), *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(90)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def counters(self) -> TierCounters:
        return tiers.scrape([self.metrics_url])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited while starting (code {proc.returncode})")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up in {timeout:.0f} s")


def joined(router_url: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listing = httpx.get(f"{router_url}/instances", timeout=5).json()["instances"]
        if sum(i["healthy"] for i in listing) >= n:
            return
        time.sleep(0.5)
    raise SystemExit(f"{n} instances did not join the router")


def run_config(name: str, with_tiers: bool, args: argparse.Namespace, conversations: list) -> dict:
    work = args.out.parent / f"{args.out.name}-{name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    router_log = open(work / "router.log", "wb")  # noqa: SIM115
    router = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port",
                               str(router_port), "--decode-policy", args.policy],
                              stdout=router_log, stderr=subprocess.STDOUT, start_new_session=True)
    common = ["--router", router_url, "--swap-space", str(args.swap_space), "--num-gpu-blocks-override",
              str(args.cache_blocks), "--max-model-len", str(args.max_model_len), "--block-size", "16"]
    instances = []
    for i in range(args.instances):
        extra = ["--kv-disk-path", str(work / f"disk-{i}"), "--enable-kv-pull"] if with_tiers else []
        instances.append(Instance(i, free_port(), free_port(), [*common, *extra], work / f"instance-{i}.log"))
    try:
        wait_healthy(router_url, router, path="/instances")  # its /health says 503 until an instance joins
        for inst in instances:
            inst.start()
        for inst in instances:
            wait_healthy(inst.url, inst.proc)
        joined(router_url, len(instances))
        total_turns = sum(len(c.user_turns) for c in conversations)
        restart = asyncio.run(_run(router_url, conversations, args, instances[1], total_turns))
        time.sleep(1.5)  # the metrics ports refresh their engine figures every second
        counters = tiers.scrape([inst.metrics_url for inst in instances])
        counters.add(restart["before"])  # the restarted instance's first life
        alone = pull_vs_compute(instances[0], instances[2], args) if with_tiers else {}
        return {"records": restart.pop("records"), "counters": counters, "restart": restart,
                "duration": restart.pop("duration"), "alone": alone}
    finally:
        for inst in instances:
            inst.stop()
        router.send_signal(signal.SIGTERM)
        router.wait(30)
        router_log.close()


async def _run(router_url: str, conversations: list, args: argparse.Namespace, victim: Instance,
               total_turns: int) -> dict:
    """The users, and beside them the restart of `victim` once --restart-at of the turns are done."""
    done = {"turns": 0}
    restart: dict = {}

    async def restart_victim() -> None:
        while done["turns"] < args.restart_at * total_turns:
            await asyncio.sleep(0.2)
        restart["before"] = await asyncio.to_thread(victim.counters)
        stopped = time.perf_counter()
        await asyncio.to_thread(victim.stop)
        restart["stop_seconds"] = time.perf_counter() - stopped
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(wait_healthy, victim.url, victim.proc)
        restart["down_seconds"] = time.perf_counter() - stopped
        restart["turns_at_stop"] = done["turns"]
        while True:  # its first requests after the restart
            await asyncio.sleep(0.5)
            counters = await asyncio.to_thread(victim.counters)
            if counters.queried_tokens > 0:
                restart["first_after"] = counters
                return

    def count(_: object) -> None:
        done["turns"] += 1

    task = asyncio.create_task(restart_victim())
    records, duration = await multiturn.run_users(router_url, conversations, None, args.think_time, 0.0,
                                                  args.seed, args.max_model_len - 64, progress=False, on_turn=count)
    try:
        await asyncio.wait_for(task, 120)
    except TimeoutError:
        restart.setdefault("first_after", TierCounters())
    return {**restart, "records": records, "duration": duration}


def pull_vs_compute(holder: Instance, puller: Instance, args: argparse.Namespace) -> dict[int, dict]:
    """One request at a time on idle instances, per prompt length: TTFT of a prompt `puller` computes (a prompt
    nobody has seen) and of one whose prefix it pulls from `holder` (which just computed it)."""
    tokenizer = Tokenizer(resolve_model_folder(None))
    text = " ".join(t for c in multiturn.sharegpt_conversations(None, 400, tokenizer, args.seed + 1, 8, 32)
                    for t in c.user_turns)
    corpus = tokenizer.encode(text)  # prompts are windows of it (wrapping around), each starting elsewhere
    port = re.findall(r"serving host-tier blocks on port (\d+)", holder.log.read_text())[-1]
    out: dict[int, dict] = {}
    offset = 0
    for length in args.alone_lengths:
        computed, pulled = [], []
        for _ in range(args.alone_repeats):
            fresh, shared = ([corpus[(offset + i * length + j) % len(corpus)] for j in range(length)]
                             for i in range(2))
            offset += 2 * length + 1
            computed.append(_ttft(puller, fresh)[0])
            _ttft(holder, shared)
            _wait_saved(holder, length // 16)
            ms, cached = _ttft(puller, shared, {"addr": f"127.0.0.1:{port}", "num_blocks": length // 16})
            pulled.append(ms)
            if cached < length - 16:
                print(f"warning: a {length}-token prompt pulled only {cached} cached tokens", file=sys.stderr)
        out[length] = {"compute_ms": float(np.median(computed)), "pull_ms": float(np.median(pulled))}
    return out


def _ttft(instance: Instance, prompt: list[int], kv_pull: dict | None = None) -> tuple[float, int]:
    """(milliseconds to the first token, cached tokens) of one greedy one-token completion."""
    body: dict = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if kv_pull:
        body["kv_pull"] = kv_pull
    start = time.perf_counter()
    r = httpx.post(f"{instance.url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    ms = (time.perf_counter() - start) * 1000
    return ms, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_saved(instance: Instance, blocks: int, timeout: float = 20) -> None:
    """Until the instance saved the prompt's blocks to its host tier (they are freed when its answer ends)."""
    before = _swap_outs(instance)
    deadline = time.monotonic() + timeout
    while _swap_outs(instance) < before + blocks - 1 and time.monotonic() < deadline:
        time.sleep(0.2)


def _swap_outs(instance: Instance) -> float:
    text = httpx.get(instance.metrics_url, timeout=10).text
    found = re.search(r'^pdserve_host_cache_swap_out_blocks_total\{dp_rank="0"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def hit_share(c: TierCounters | None) -> float:
    return sum(c.hit_tokens.values()) / c.queried_tokens if c is not None and c.queried_tokens else 0.0


def later_ttft(records: list, min_prompt: int = 0) -> tuple[float, float, int]:
    ttfts = [r.ttft * 1000 for r in records if r.ok and r.turn >= 1 and r.prompt_tokens >= min_prompt]
    if not ttfts:
        return float("nan"), float("nan"), 0
    return float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 90)), len(ttfts)


def report(runs: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [f"{args.users} users x <= {args.turns} ShareGPT turns ({args.output_len} output tokens each, greedy) "
             f"over {args.instances} mixed instances (router: {args.policy}); instance 1 stopped (SIGTERM) and started "
             f"again after {args.restart_at:.0%} of the turns", "",
             "| config | later-turn TTFT p50 / p90 ms | prompt >= 1,000: p50 / p90 ms (n) | hit share: device / host /"
             " disk / pulled | prefill s saved: host / disk / pulled | restarted instance hit share: before / "
             "first after |", "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        c, r = run["counters"], run["restart"]
        p50, p90, _ = later_ttft(run["records"])
        lp50, lp90, ln = later_ttft(run["records"], LONG_PREFIX)
        shares = " / ".join(f"{c.hit_tokens[t] / c.queried_tokens:.2f}" if c.queried_tokens else "0"
                            for t in tiers.TIERS)
        saved = " / ".join("n/a" if (x := c.saved_seconds(t)) is None else f"{x:.1f}" for t in tiers.TIERS[1:])
        lines.append(f"| {name} | {p50:.0f} / {p90:.0f} | {lp50:.0f} / {lp90:.0f} ({ln}) | {shares} | {saved} | "
                     f"{hit_share(r.get('before')):.2f} / {hit_share(r.get('first_after')):.2f} |")
    (base, with_tiers) = runs.values()
    if alone := with_tiers.get("alone"):
        lines += ["", "One request at a time on idle instances (the tiers deployment after its run), TTFT p50 of "
                  f"{args.alone_repeats}: a prompt the instance computes / one whose prefix it pulls from a peer:",
                  "", "| prompt tokens | compute ms | pull ms | pull / compute |", "|---|---|---|---|"]
        lines += [f"| {n} | {a['compute_ms']:.0f} | {a['pull_ms']:.0f} | {a['pull_ms'] / a['compute_ms']:.2f}x |"
                  for n, a in alone.items()]
    b, t = later_ttft(base["records"], LONG_PREFIX)[0], later_ttft(with_tiers["records"], LONG_PREFIX)[0]
    b_all, t_all = later_ttft(base["records"])[0], later_ttft(with_tiers["records"])[0]
    before = hit_share(with_tiers["restart"].get("before"))
    after = hit_share(with_tiers["restart"].get("first_after"))
    lines += ["", f"later-turn TTFT p50, tiers / host tier only: {t_all / b_all:.2f}x (all), {t / b:.2f}x "
              f"(prompt >= {LONG_PREFIX} tokens; goal <= 0.6x)",
              f"restarted instance's hit share on its first requests / before its stop: "
              f"{after / before if before else float('nan'):.2f}x with tiers (goal >= 0.9x), "
              f"{hit_share(base['restart'].get('first_after')):.2f} after / "
              f"{hit_share(base['restart'].get('before')):.2f} before without",
              f"stop with the disk tier's dump: {with_tiers['restart'].get('stop_seconds', 0):.1f} s, back after "
              f"{with_tiers['restart'].get('down_seconds', 0):.1f} s (without: "
              f"{base['restart'].get('stop_seconds', 0):.1f} s, {base['restart'].get('down_seconds', 0):.1f} s)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6, help="user turns per conversation at most")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--think-time", type=float, default=1.0, help="mean seconds between a user's turns")
    parser.add_argument("--restart-at", type=float, default=0.4, help="share of the turns done when instance 1 stops")
    parser.add_argument("--swap-space", type=float, default=0.5, help="GB of host tier per instance")
    parser.add_argument("--cache-blocks", type=int, default=256, help="device cache per instance, 16-token blocks")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--policy", default="round_robin",
                        help="the router's pick among the mixed instances (--decode-policy); round_robin spreads a "
                             "conversation's turns over them all, cache_aware keeps them where their prefix is")
    parser.add_argument("--alone-lengths", type=int, nargs="+", default=[1024, 2048, 3072],
                        help="prompt lengths of the one-at-a-time pull-or-compute comparison")
    parser.add_argument("--alone-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/kv_tiers"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PDSERVE_CLUSTER_SECRET", os.urandom(16).hex())  # the router and its instances share it
    tokenizer = Tokenizer(resolve_model_folder(None))
    conversations = multiturn.sharegpt_conversations(None, args.users, tokenizer, args.seed, args.turns,
                                                     args.output_len)
    runs = {"host tier only": run_config("host", False, args, conversations),
            "+ disk tier + pulls": run_config("tiers", True, args, conversations)}
    table = report(runs, args)
    args.out.with_suffix(".md").write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(
        {name: {"counters": vars(r["counters"]), "restart_turns": r["restart"].get("turns_at_stop"),
                "duration": r["duration"], "alone": r["alone"]} for name, r in runs.items()}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
