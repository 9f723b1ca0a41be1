"""What tracing costs: TPOT and throughput of a deployment with --otlp-traces-endpoint against the same deployment
without it (goal: at most 2% with a span per request, every trace sampled).

    .venv/bin/python bench/tracing_cost.py [--deployment 1p1d|mixed] [--rounds 2] [--num-prompts 64]
        [--max-concurrency 8] [--output-len 128] [--detailed] [--out bench-results/tracing_cost]

Each run is a fresh deployment (`pdserve launch`) loaded by `pdserve bench serve` with the same ShareGPT prompts
(greedy, --ignore-eos at --output-len: every run computes the same tokens); runs alternate off, on, off, on ...
so both see the same machine drift. With tracing on, the spans go to a collector in this process that only reads
them and answers 200 (a real one runs elsewhere). Prints each run, then the medians over runs and on/off ratios
(a median: one run disturbed by something else on the box moves it least).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pd_sweep import served

DEPLOYMENTS = {
    "1p1d": ["launch", "--prefill", "1", "--decode", "1", "--routers", "1", "--pd-policy", "always"],
    "mixed": ["launch", "--mixed", "1", "--routers", "1"],
}
FLAGS = ["--port", "{port}", "--kv-cache-memory", "1G", "--max-model-len", "4096"]


class Collector:
    """An OTLP/HTTP endpoint that reads what it is sent and counts it."""

    def __init__(self) -> None:
        self.posts = self.bytes = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers["Content-Length"])
                self.rfile.read(n)
                collector.posts, collector.bytes = collector.posts + 1, collector.bytes + n
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"


def load(url: str, args: argparse.Namespace, result: Path) -> dict:
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--dataset", "sharegpt",
                    "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
                    "--request-rate", "inf", "--sharegpt-output-len", str(args.output_len), "--ignore-eos",
                    "--temperature", "0", "--seed", "0", "--save-result", str(result), "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["summary"]


def run(traced: bool, i: int, args: argparse.Namespace, collector: Collector) -> dict:
    command = [sys.executable, "-m", "pdserve.cli", *DEPLOYMENTS[args.deployment], *FLAGS]
    if traced:
        command += ["--otlp-traces-endpoint", collector.url] + (["--collect-detailed-traces"] if args.detailed else [])
    name = f"{'on' if traced else 'off'}-{i}"
    posts = collector.posts
    with served(name, command, {"OTEL_TRACES_SAMPLER": "always_on"}, args.out.with_name(f"{args.out.name}-{name}.log")
                ) as url:
        s = load(url, args, args.out.with_name(f"{args.out.name}-{name}.json"))
    row = {"run": name, "tpot_ms": s["tpot"]["mean"], "itl_p99_ms": s["itl"]["percentiles"].get("P99"),
           "ttft_ms": s["ttft"]["median"], "output_tok_s": s["output_throughput"], "completed": s["completed"],
           "failed": s["failed"], "exports": collector.posts - posts}
    print(f"  {name}: TPOT {row['tpot_ms']:.2f} ms, TTFT p50 {row['ttft_ms']:.0f} ms, {row['output_tok_s']:.1f} "
          f"output tok/s, {row['completed']} done / {row['failed']} failed, {row['exports']} span batches",
          flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deployment", choices=sorted(DEPLOYMENTS), default="1p1d")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--detailed", action="store_true", help="also --collect-detailed-traces (a span per step)")
    p.add_argument("--out", type=Path, default=Path("bench-results/tracing_cost"))
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    collector = Collector()
    rows = [run(traced, i, args, collector) for i in range(args.rounds) for traced in (False, True)]
    off = [r for r in rows if r["run"].startswith("off")]
    on = [r for r in rows if r["run"].startswith("on")]
    print(f"\n{args.deployment}, {args.num_prompts} ShareGPT prompts, concurrency {args.max_concurrency}, "
          f"{args.output_len} tokens each, greedy; tracing on: every request traced"
          f"{' with a span per step' if args.detailed else ''}")
    print(f"{'median of runs':22}{'off':>10}{'on':>10}{'on/off':>9}")
    for key, label in (("tpot_ms", "TPOT mean ms"), ("itl_p99_ms", "ITL p99 ms"), ("ttft_ms", "TTFT p50 ms"),
                       ("output_tok_s", "output tok/s")):
        a, b = statistics.median(r[key] for r in off), statistics.median(r[key] for r in on)
        print(f"{label:22}{a:>10.2f}{b:>10.2f}{b / a:>9.3f}")
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
