"""The decode host buffer (`--splitwise-cache-buffer-size`) on a decode-bound load, with and without it.

    .venv/bin/python bench/decode_buffer.py [--num-prompts 24] [--request-rate 2] [--input-len 512]
        [--output-len 256] [--decode-blocks 48] [--buffer-gb 0.5] [--out bench-results/decode_buffer]

Router + 1 prefill (core 0) + 1 decode (core 1) whose cache holds only a few requests
(--decode-blocks), one deployment after the other on the same cores, the same Poisson load (long
outputs, EOS ignored) measured by `pdserve bench serve`. From the decode instance's per-request
timings it reports:
- P holds blocks: P's prefill start -> D has the KV (D acks at once, P frees its blocks then);
- P waits on D: the request's arrival -> D names its destination blocks (P cannot start before);
- buffer wait: KV complete in D's buffer -> D's cache blocks taken (buffer runs only);
- TTFT p50/p99 at the client, D's decode tokens/s and its mean decode batch.

pdserve's P never holds blocks while D is full (it prefills only once D has named the destination),
so the buffer's effect shows as P's wait on D, not as P's holding time (FastDeploy's P prefills
first and holds its blocks until D has room).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from pd_sweep import wait_healthy

from pdserve.api.serve import free_port


def start(command: list[str], cpus: set[int] | None, log: Path) -> subprocess.Popen:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(len(cpus))} if cpus else {})}
    return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *command], stdout=open(log, "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def deployment(name: str, buffer_gb: float, args: argparse.Namespace) -> dict:
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    common = ["--router", router_url, "--max-model-len", "2048", "--cache-transfer-protocol", "ipc"]
    log = args.out.with_name(f"{args.out.name}-{name}")
    cpus = [{0}, {1}] if (os.cpu_count() or 1) >= 2 else [None, None]
    procs = [start(["router", "--port", str(router_port)], None, log.with_suffix(".router.log"))]
    try:
        p_port, d_port = free_port(), free_port()
        procs.append(start(["serve", "--splitwise-role", "prefill", "--port", str(p_port), "--kv-cache-memory",
                            "2G", *common], cpus[0], log.with_suffix(".p.log")))
        buffer = ["--splitwise-cache-buffer-size", str(buffer_gb)] if buffer_gb else []
        procs.append(start(["serve", "--splitwise-role", "decode", "--port", str(d_port), "--num-gpu-blocks-override",
                            str(args.decode_blocks), *buffer, *common], cpus[1], log.with_suffix(".d.log")))
        wait_healthy(router_url, procs[0], "the 1P1D deployment", timeout=600)
        result = log.with_suffix(".json")
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", router_url,
                        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                        "--ignore-eos", "--save-result", str(result), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(result.read_text())
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(60)


def figures(run: dict) -> dict[str, float]:
    records = [r for r in run["requests"] if r["ok"]]
    server = [r["server"] for r in records]

    def pct(pairs: list[float], q: float) -> float:
        return float(np.percentile(pairs, q)) * 1000 if pairs else float("nan")

    holds = [s["prefill_done_received"] - s["prefill_start"] for s in server]
    waits = [s["cache_info_sent"] - s["arrival"] for s in server]
    buffer_waits = [s["swap_started"] - s["buffered"] for s in server if s.get("buffered")]
    decoding = sum(s["finished"] - s["first_token"] for s in server)
    span = max(s["finished"] for s in server) - min(s["arrival"] for s in server)
    summary = run["summary"]
    return {"P holds blocks p50": pct(holds, 50), "P holds blocks p99": pct(holds, 99),
            "P waits on D p50": pct(waits, 50), "P waits on D p99": pct(waits, 99),
            "buffer wait p50": pct(buffer_waits, 50), "TTFT p50": summary["ttft"]["median"],
            "TTFT p99": summary["ttft"]["percentiles"]["P99"], "D decode tok/s": summary["output_throughput"],
            "D mean decode batch": decoding / span}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--decode-blocks", type=int, default=48, help="D's cache, in 64-token blocks")
    parser.add_argument("--buffer-gb", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=Path("bench-results/decode_buffer"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = {"no buffer": figures(deployment("plain", 0, args)),
            f"buffer {args.buffer_gb:g} GB": figures(deployment("buffer", args.buffer_gb, args))}
    columns = list(next(iter(runs.values())))
    lines = [f"{args.num_prompts} prompts {args.input_len} -> {args.output_len} tokens at {args.request_rate:g} req/s; "
             f"D's cache {args.decode_blocks} blocks; ms unless named", "",
             "| deployment | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in runs.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")
    plain, buffered = runs.values()
    lines += ["", "with the buffer / without: " + ", ".join(
        f"{c} {buffered[c] / plain[c]:.2f}x" for c in ("P waits on D p99", "TTFT p99", "D decode tok/s")
        if plain[c])]
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
