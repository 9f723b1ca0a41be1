"""The host prefix tier (`--swap-space`) on a shared-prefix workload bigger than the KV cache.

    .venv/bin/python bench/host_tier.py [--prefixes 8] [--prefix-len 1024] [--requests 48]
        [--cache-blocks 48] [--swap-space 1] [--out bench-results/host_tier]

Two `pdserve serve` instances, one after the other on the same cores, with the same small cache
(--num-gpu-blocks-override): without and with --swap-space. Each gets the same requests, one at a
time (`pdserve bench serve --max-concurrency 1`): one of --prefixes long system prompts drawn at
random, then a question of its own. The prefixes together need more blocks than the cache has, so
the device cache alone keeps losing them. Prints the prefix hit rate, the host tier's hits and TTFT
p50/p99 of both, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from pd_sweep import wait_healthy

from pdserve.api.serve import free_port

QUESTIONS = ["What is the main point?", "Summarize it in one line.", "Name one detail.", "Who would care?",
             "What comes next?", "Is any of it wrong?", "Give it a title.", "What is missing?"]


def workload(args: argparse.Namespace, path: Path) -> None:
    """Prefixes of about --prefix-len tokens (random vocabulary words), each request one of them + a question."""
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_folder(None))
    rng = random.Random(0)
    words = [w for w in (tok.decode([t]).strip() for t in range(1000, 20000)) if w.isalpha() and len(w) > 2]
    prefixes = []
    for _ in range(args.prefixes):
        text = ""
        while len(tok.encode(text)) < args.prefix_len:
            text += " ".join(rng.choice(words) for _ in range(64)) + ". "
        prefixes.append(text)
    with open(path, "w") as f:
        for i in range(args.requests):
            prompt = f"{rng.choice(prefixes)}\nQuestion {i}: {rng.choice(QUESTIONS)}\nAnswer:"
            f.write(json.dumps({"prompt": prompt, "max_tokens": args.output_len}) + "\n")


def measure(name: str, extra: list[str], data: Path, args: argparse.Namespace) -> dict:
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--metrics-port",
               str(metrics_port), "--num-gpu-blocks-override", str(args.cache_blocks), "--max-model-len", "2048",
               *extra]
    log = open(args.out.with_name(f"{args.out.name}-{name}.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    result = args.out.with_name(f"{args.out.name}-{name}.json")
    try:
        wait_healthy(url, proc, name)
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--dataset",
                        "jsonl", str(data), "--num-prompts", str(args.requests), "--max-concurrency", "1",
                        "--request-rate", "inf", "--save-result", str(result), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        time.sleep(1.5)  # the metrics port refreshes its engine figures every second
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                   if line.startswith("pdserve_") and "{" not in line}
        return {"summary": json.loads(result.read_text())["summary"], "metrics": metrics}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=48, help="the device cache, in 64-token blocks")
    parser.add_argument("--swap-space", type=float, default=1.0, help="GB of host tier for the second instance")
    parser.add_argument("--out", type=Path, default=Path("bench-results/host_tier"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = args.out.with_name(f"{args.out.name}-workload.jsonl")
    workload(args, data)
    runs = {"device cache only": measure("device", [], data, args),
            f"--swap-space {args.swap_space:g}": measure("host", ["--swap-space", str(args.swap_space)], data, args)}
    lines = [f"{args.requests} requests one at a time, {args.prefixes} prefixes of ~{args.prefix_len} tokens "
             f"(~{args.prefixes * args.prefix_len // 64} blocks) over a {args.cache_blocks}-block cache; ms", "",
             "| cache | prefix hit rate | host-tier hit blocks | TTFT p50 | TTFT p99 | E2EL p50 |",
             "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        s, m = run["summary"], run["metrics"]
        hit_rate = m["pdserve_prefix_cache_hits_total"] / max(1, m["pdserve_prefix_cache_queries_total"])
        lines.append(f"| {name} | {hit_rate:.2f} | "
                     f"{m.get('pdserve_host_cache_hit_blocks_total', 0):.0f} | {s['ttft']['median']:.0f} | "
                     f"{s['ttft']['percentiles']['P99']:.0f} | {s['e2el']['median']:.0f} |")
    m = runs[f"--swap-space {args.swap_space:g}"]["metrics"]
    if m.get("pdserve_host_cache_swap_in_blocks_total"):
        blocks = m["pdserve_host_cache_swap_in_blocks_total"]
        lines += ["", f"host -> cache loads: {blocks:.0f} blocks, "
                  f"{1000 * m['pdserve_host_cache_swap_in_seconds_total'] / blocks:.3f} "
                  f"ms per block as the engine waited for them (round trip to the cache service included)"]
    base, tier = (r["summary"] for r in runs.values())
    lines += ["", f"TTFT p50 with the host tier / without: {tier['ttft']['median'] / base['ttft']['median']:.2f}x"]
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
