"""The same random workload against three deployments on this machine, one comparison table and plot.

    .venv/bin/python bench/pd_sweep.py [--num-prompts 30] [--request-rate 0.5] [--input-len 512] [--output-len 64]
                                       [--out bench-results/pd_sweep]

Deployments: a mixed instance (direct), the router in front of a mixed instance, and router + 1 prefill
+ 1 decode (`pdserve launch`). Each is measured with `pdserve bench serve`; the script writes
OUT.md (a markdown table), OUT.png (TTFT and ITL percentiles side by side) and OUT-<name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pdserve.api.serve import free_port

FLAGS = ["--kv-cache-memory", "2G", "--max-model-len", "2048"]
DEPLOYMENTS = {
    "mixed": lambda port: ["serve", "--port", str(port), *FLAGS],
    "router + mixed": lambda port: ["launch", "--prefill", "0", "--decode", "0", "--mixed", "1", "--port", str(port),
                                    *FLAGS],
    "router + 1P1D": lambda port: ["launch", "--prefill", "1", "--decode", "1", "--port", str(port), *FLAGS],
}
COLUMNS = [("req/s", "request_throughput", None), ("out tok/s", "output_throughput", None),
           ("TTFT p50 ms", "ttft", "median"), ("TTFT p99 ms", "ttft", "P99"), ("ITL p50 ms", "itl", "median"),
           ("ITL p99 ms", "itl", "P99"), ("decode p50 tok/s", "decode", "median"), ("E2EL p50 ms", "e2el", "median")]


def wait_healthy(url: str, proc: subprocess.Popen, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not come up")
        time.sleep(1)


@contextmanager
def served(key: str, command: list[str], env: dict[str, str], log_path: Path) -> Iterator[str]:
    """A server started from `command` ("{port}" filled in) until healthy; its URL; stopped after."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([c.replace("{port}", str(port)) for c in command], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, key, timeout=900)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)


def bench_serve(url: str, args: argparse.Namespace, rate: float, result: Path, seed: int = 0) -> dict:
    """`pdserve bench serve` against URL with the workload in args; its summary. Runs against one server
    need distinct seeds: the same prompts again would be answered from its prefix cache."""
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--seed", str(seed),
                    "--num-prompts",
                    str(args.num_prompts), "--request-rate", str(rate), "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len), "--ignore-eos", "--save-result", str(result),
                    "--no-progress"], check=True)
    return json.loads(result.read_text())["summary"]


def run_one(name: str, args: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *DEPLOYMENTS[name](port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, name)
        result = out.with_name(f"{out.name}-{name.replace(' ', '').replace('+', '_')}.json")
        return bench_serve(url, args, args.request_rate, result)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--request-rate", type=float, default=0.5)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/pd_sweep"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summaries = {name: run_one(name, args, args.out) for name in DEPLOYMENTS}

    def cell(s: dict, key: str, sub: str | None) -> str:
        v = s[key] if sub is None else (s[key][sub] if sub == "median" else s[key]["percentiles"].get(sub))
        return "n/a" if v is None else f"{v:.1f}"

    lines = [f"Workload: {args.num_prompts} random prompts of {args.input_len} tokens -> {args.output_len} tokens, "
             f"{args.request_rate} req/s (Poisson), this machine.", "",
             "| deployment | " + " | ".join(c for c, _, _ in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cell(s, k, sub) for _, k, sub in COLUMNS) + " |"
              for name, s in summaries.items()]
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    _plot(summaries, args.out.with_suffix(".png"))


def _plot(summaries: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        labels = ["median", "P95", "P99"]
        for i, (name, s) in enumerate(summaries.items()):
            values = [s[metric]["median"] or 0, s[metric]["percentiles"].get("P95") or 0,
                      s[metric]["percentiles"].get("P99") or 0]
            ax.bar([x + i * 0.25 for x in range(3)], values, width=0.25, label=name)
        ax.set_xticks([x + 0.25 for x in range(3)], labels)
        ax.set(title=metric.upper(), ylabel="ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
