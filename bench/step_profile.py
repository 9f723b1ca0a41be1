"""Where a step's time goes, beside what this machine allows: a profile of pdserve's forward step by op class,
the engine's whole step around it, and the box's own limits (a GEMM and a copy microbenchmark).

    .venv/bin/python bench/step_profile.py [--dtypes bfloat16,float32] [--reps 5] [--no-engine]
                                           [--vllm-python V/bin/python] [--out bench-results/step_profile.md]

Shapes: decode at batch 1, 16 and 64 over contexts of 256 and 1,024 tokens, and one prefill of 1,000 tokens.
For each: the step's wall time (median of --reps, no profiler), then one profiled step split by op class: the
linears (oneDNN), the logits (the lm_head of the last tokens), attention (paged kernel, K/V writes), small ops
(norms, RoPE, SwiGLU, embedding, adds), and between ops (Python, dispatch, the batch's metadata): the wall time
less every op's own time. Beside it: sampling the step's logits (greedy, and temperature 0.8 + top-p 0.95), and
with the engine (`LLM`), a decode step as the engine runs it, whose difference from forward + greedy sampling is
the engine's own cost (scheduling, worker <-> engine messages, output handling).
Limits: the matmul rate of the model's MLP shape at 1,024 / 64 / 16 / 1 rows, a 256 MB copy's rate (read + write)
and a 512 MB sum's (read); from them the prefill bound (the linears of a token at the 1,024-row rate) and the
batch-1 decode floor (every weight read once). With --vllm-python, vLLM's CPU build runs the same shapes
(bench/peers/vllm_step_profile.py: its engine in-process, profiled alike) and its rows are printed beside ours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
from profile_classes import CLASSES, classify  # beside this script

DECODES = [(1, 256), (16, 256), (64, 256), (1, 1024), (16, 1024), (64, 1024)]
PREFILL = 1000


def machine() -> str:
    flags = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa)}, torch {torch.__version__}"


def _median_seconds(fn, reps: int, warmup: int = 2, best: bool = False) -> float:  # noqa: ANN001
    """The median of `reps` timed calls, or with `best` the fastest (a limit is what the box can do)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) if best else statistics.median(times)


def limits(dtype: torch.dtype, reps: int) -> dict:
    """GEMM GFLOP/s of the MLP's gate|up shape (rows x 576 @ 576 x 3,072, the weight in L2: a matmul's own rate)
    through oneDNN as the model calls it (packed weight), and memory GB/s."""
    from pdserve.model.linear import make_linear

    out: dict = {"gemm_gflops": {}}
    linear = make_linear(torch.randn(3072, 576, dtype=dtype), None, None)
    for rows in (1024, 64, 16, 1):
        x = torch.randn(rows, 576, dtype=dtype)
        s = _median_seconds(lambda x=x: linear(x), reps * 4, best=True)
        out["gemm_gflops"][rows] = 2 * rows * 576 * 3072 / s / 1e9
    a = torch.ones(256 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    out["copy_gbs"] = 2 * a.numel() / _median_seconds(lambda: b.copy_(a), reps, best=True) / 1e9
    big = torch.ones(128 << 20, dtype=torch.float32)
    out["read_gbs"] = big.numel() * 4 / _median_seconds(lambda: big.sum(), reps, best=True) / 1e9
    return out


def linear_params(runner) -> tuple[int, int]:  # noqa: ANN001
    """(weights of the decoder layers' linears, of the lm_head), as counts of numbers."""
    c = runner.config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    return per_layer * c.num_layers, c.vocab_size * c.hidden_size


class Steps:
    """pdserve's forward pass on chosen shapes, with a KV cache big enough for the largest."""

    def __init__(self, dtype: str) -> None:
        from pdserve.sampling.sampler import Sampler
        from pdserve.worker.model_runner import ModelRunner

        self.runner = ModelRunner(None, dtype=dtype, device="cpu", max_model_len=2048)
        bs = self.runner.block_size
        self.per_seq = -(-(max(c for _, c in DECODES) + 1) // bs)
        blocks = max(max(b for b, _ in DECODES) * self.per_seq, -(-PREFILL // bs))
        self.runner.allocate_kv_cache(blocks)
        self.sampler = Sampler()
        self.logits_label()

    def logits_label(self) -> None:
        """The lm_head under a profiler label, so its linear counts as the logits."""
        model = self.runner.model
        inner = model.lm_head_proj

        def labelled(x: torch.Tensor) -> torch.Tensor:
            with torch.profiler.record_function("logits"):
                return inner(x)

        model.lm_head_proj = labelled

    def decode(self, batch: int, context: int):  # noqa: ANN201
        from pdserve.model import SequenceChunk

        chunks = [SequenceChunk([100 + i], context, list(range(i * self.per_seq, (i + 1) * self.per_seq)))
                  for i in range(batch)]
        return lambda: self.runner.logits(chunks)

    def prefill(self, tokens: int):  # noqa: ANN201
        from pdserve.model import SequenceChunk

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 49152, (tokens,), generator=g).tolist()
        chunk = SequenceChunk(ids, 0, list(range(-(-tokens // self.runner.block_size))))
        return lambda: self.runner.logits([chunk])

    def sampling_ms(self, logits: torch.Tensor, reps: int) -> tuple[float, float]:
        """On peaked rows like a chat's next-token logits (a few dozen likely tokens over a long tail): the
        forward's own logits, from random tokens over an empty cache, are flat, and a flat row's nucleus sends
        top-p to its full sort."""
        from pdserve.sampling.sampler import SamplingRow
        from pdserve.sampling.sampling_params import SamplingParams

        g = torch.Generator().manual_seed(len(logits))
        logits = torch.randn(logits.shape, generator=g) * 2.5
        logits[:, :50] += torch.linspace(12, 4, 50)
        greedy = [SamplingRow(SamplingParams(temperature=0), [], []) for _ in range(len(logits))]
        sampled = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95), [], []) for _ in range(len(logits))]
        return (1e3 * _median_seconds(lambda: self.sampler(logits, greedy), reps),
                1e3 * _median_seconds(lambda: self.sampler(logits, sampled), reps))


def profile_step(fn, reps: int) -> dict:  # noqa: ANN001
    """{wall ms (unprofiled median), ms by op class in one profiled step, between ops}."""
    wall = _median_seconds(fn, reps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    by_class: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.is_user_annotation or event.name == "logits":
            continue
        by_class[classify(event.name, _under_logits(event))] += event.self_cpu_time_total / 1e3
    row = {"wall_ms": wall * 1e3, **{k: by_class.get(k, 0.0) for k in CLASSES}}
    row["between ops"] = max(0.0, row["wall_ms"] - sum(by_class.values()))
    return row


def _under_logits(event) -> bool:  # noqa: ANN001
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == "logits":
            return True
        parent = parent.cpu_parent
    return False


def engine_steps_ms(dtype: str, new_tokens: int = 48, repeats: int = 3) -> dict[str, float]:
    """Steps as the engine runs them, by shape: a decode step is (T(1 + N tokens) - T(1 token)) / N for `batch`
    prompts already in the prefix cache (the median of `repeats`); a prefill is T(1 token) of a prompt never
    seen."""
    from pdserve import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    out = {}
    with LLM(dtype=dtype, max_num_seqs=64, max_model_len=2048, kv_cache_memory=3 << 30) as llm:
        def run(prompts: list[dict], n: int) -> float:
            p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(prompts, p, use_tqdm=False)
            return time.perf_counter() - t

        for batch, context in DECODES:
            prompts = [{"prompt_token_ids": torch.randint(100, 49152, (context,), generator=g).tolist()}
                       for _ in range(batch)]
            run(prompts, 2)  # now in the prefix cache: both timed runs skip the prefill alike
            out[f"decode {batch} x {context}"] = 1e3 * statistics.median(
                (run(prompts, 1 + new_tokens) - run(prompts, 1)) / new_tokens for _ in range(repeats))
        fresh = [[{"prompt_token_ids": torch.randint(100, 49152, (PREFILL,), generator=g).tolist()}] for _ in range(3)]
        out[f"prefill {PREFILL}"] = 1e3 * statistics.median(run(p, 1) for p in fresh)
    return out


def ours(dtype: str, reps: int, with_engine: bool) -> dict:
    steps = Steps(dtype)
    runner = steps.runner
    result: dict = {"dtype": str(runner.dtype).removeprefix("torch."), "rows": []}
    layers, head = linear_params(runner)
    result["params"] = (layers, head)
    for batch, context in DECODES:
        fn = steps.decode(batch, context)
        row = {"shape": f"decode {batch} x {context}", **profile_step(fn, reps)}
        row["greedy_ms"], row["sampled_ms"] = steps.sampling_ms(fn(), reps)
        result["rows"].append(row)
    row = {"shape": f"prefill {PREFILL}", **profile_step(steps.prefill(PREFILL), max(2, reps // 2))}
    result["rows"].append(row)
    runner.release()
    del steps
    if with_engine:
        engine = engine_steps_ms(dtype)
        for row in result["rows"]:
            row["engine_ms"] = engine[row["shape"]]
    return result


def theirs(python: str, dtype: str, reps: int) -> dict | None:
    script = Path(__file__).parent / "peers" / "vllm_step_profile.py"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    from pdserve.loader import resolve_model_folder

    spec = json.dumps({"decodes": DECODES, "prefill": PREFILL, "reps": reps, "dtype": dtype})
    proc = subprocess.run([python, str(script), str(resolve_model_folder(None)), spec], capture_output=True,
                          text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"vLLM's run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return None
    return json.loads(lines[-1])


def table(ours_result: dict, lim: dict, peer: dict | None) -> list[str]:
    cols = ["wall_ms", *CLASSES, "between ops", "greedy_ms", "sampled_ms", "engine_ms"]
    lines = [f"### {ours_result['dtype']}", "",
             "| shape | forward ms | " + " | ".join(c.replace("_ms", "") for c in cols[1:])
             + " | vLLM engine ms | vLLM / ours |",
             "|---" * (len(cols) + 3) + "|"]
    peer_rows = {r["shape"]: r for r in (peer or {}).get("rows", [])}
    for row in ours_result["rows"]:
        cells = [f"{row[c]:.1f}" if c in row else "-" for c in cols]
        other = peer_rows.get(row["shape"], {}).get("engine_ms")
        compare = f"{other:.1f} | {other / row['engine_ms']:.2f}x" if other and row.get("engine_ms") else "- | -"
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + f" | {compare} |")
    layers, head = ours_result["params"]
    itemsize = torch.empty(0, dtype=getattr(torch, ours_result["dtype"])).element_size()
    rate = lim["gemm_gflops"][1024]
    prefill_bound = rate * 1e9 / (2 * layers)
    floor_ms = 1e3 * (layers + head) * itemsize / (lim["read_gbs"] * 1e9)
    prefill = next(r for r in ours_result["rows"] if r["shape"].startswith("prefill"))
    decode1 = next(r for r in ours_result["rows"] if r["shape"] == "decode 1 x 256")
    lines += ["", f"Limits: GEMM {', '.join(f'{r} rows {g:.0f}' for r, g in lim['gemm_gflops'].items())} GFLOP/s; "
              f"copy {lim['copy_gbs']:.1f} GB/s (read + write), read {lim['read_gbs']:.1f} GB/s.",
              f"Prefill: {PREFILL / prefill['wall_ms'] * 1e3:.0f} tok/s against {prefill_bound:.0f} for the linears "
              f"at the 1,024-row rate ({PREFILL / prefill['wall_ms'] * 1e3 / prefill_bound:.2f} of it). "
              f"Batch-1 decode: {decode1['wall_ms']:.1f} ms against a {floor_ms:.1f} ms weight read "
              f"({decode1['wall_ms'] / floor_ms:.2f}x)."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-engine", action="store_true", help="skip the engine's steps (LLM)")
    parser.add_argument("--vllm-python", default=None, help="vLLM's CPU build's python: its rows beside ours")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    lines = [f"# Step profile: {machine()}", "",
             "ms per step. forward: the model runner's forward pass alone (no sampling); its op classes from one "
             "profiled step (the profiler adds a little to each op); between ops = forward - every op's own time; "
             "greedy / sampled: the sampler on its logits; engine: the whole step inside `LLM` (scheduling, "
             "messages, sampling, outputs), the figure set beside vLLM's engine step on the same shape.",
             ""]
    for dtype in args.dtypes.split(","):
        lim = limits(getattr(torch, dtype), args.reps)
        result = ours(dtype, args.reps, not args.no_engine)
        peer = theirs(args.vllm_python, dtype, args.reps) if args.vllm_python else None
        lines += table(result, lim, peer) + [""]
        if peer:
            lines += ["vLLM's profiled decode by op class (% of its op time): " + "; ".join(
                f"{r['shape']}: " + ", ".join(f"{k} {v:.0f}%" for k, v in r["classes"].items() if v >= 0.5)
                for r in peer["rows"] if "classes" in r), ""]
        print("\n".join(lines), flush=True)
    text = "\n".join(lines)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
