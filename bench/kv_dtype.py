"""8-bit KV caches beside the model-dtype cache, in one run (`--kv-cache-dtype fp8 | fp8_e5m2 | int8`).

    .venv/bin/python bench/kv_dtype.py [--dtypes auto,fp8,int8] [--reps 7] [--no-pd] [--out FILE.md]
        [--model FILE --shapes 16x4096,64x1024]   (another model: capacity and steps only)

Per KV dtype, on the embedded model (SmolLM2-135M: 30 layers, 3 KV heads of 64) in the machine's model dtype:
  - capacity: the tokens a 2 GiB cache holds (the block's bytes, scales included, as the engine sizes its cache);
  - decode step: one real forward of 16 and 64 streams, each at 1,024 and 4,096 tokens of context (random cache
    contents, blocks scattered over the cache as a serving cache's are), the dtypes taking turns rep by rep;
    the median, and its ratio to the model-dtype cache;
  - PD: `pdserve launch --prefill 1 --decode 1` with that KV dtype; 8 ShareGPT prompts of 1,000 tokens, one at a
    time: the KV bytes D received per prompt token, the span from P's first layer written to D told the prefill is
    done (the layers go out while P computes the next), and the tail after P's last layer, from the responses'
    `collect_metrics`;
  - quality: a held-out ShareGPT text's negative log-likelihood (one prompt pass, which attends over the cache as
    written) against the model-dtype cache's, and teacher-forced agreement of the next token with it over 8
    ShareGPT prompts x 32 steps (all steps, and the steps where its top two are a logit apart or more);
  - scale granularity: on the model's own K and V of that text, the relative RMS error of each 8-bit format with a
    scale per (token, KV head), which pdserve stores, beside one scale per (64-token block, KV head).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from pd_sweep import served  # noqa: E402
from step_profile import machine  # noqa: E402

from pdserve.bench_serve.sharegpt import conversations, default_path, read_entries  # noqa: E402
from pdserve.loader import resolve_model_folder  # noqa: E402
from pdserve.model import SequenceChunk, kv_codes  # noqa: E402
from pdserve.tokenization.tokenizer import Tokenizer  # noqa: E402
from pdserve.worker.model_runner import ModelRunner  # noqa: E402

SHAPES = [(16, 1024), (64, 1024), (16, 4096), (64, 4096)]
BUDGET = 2 << 30
CODES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
         "int8": torch.int8}


def sharegpt_texts(n: int) -> list[str]:
    return [a for _, a in conversations(read_entries(default_path()), seed=0)][:n]


# ---- capacity and decode steps ---------------------------------------------------------------------------------

def capacity(runners: dict[str, ModelRunner]) -> dict[str, int]:
    out = {}
    for name, runner in runners.items():
        layout = runner.layout(1)
        out[name] = BUDGET // layout.block_bytes * layout.block_size
    return out


def step_times(runners: dict[str, ModelRunner], reps: int) -> dict[tuple[int, int], dict[str, float]]:
    out = {}
    for batch, context in SHAPES:
        bs = next(iter(runners.values())).block_size
        per_seq = -(-(context + 1) // bs)
        g = torch.Generator().manual_seed(batch + context)
        order = torch.randperm(batch * per_seq, generator=g).tolist()
        chunks = [SequenceChunk([100 + i], context, order[i * per_seq:(i + 1) * per_seq]) for i in range(batch)]
        for runner in runners.values():
            cache = runner.allocate_kv_cache(batch * per_seq)
            if cache.layout.quantized:  # small codes, one plain scale: no NaN codes or subnormal scales
                cache.parts[0].view(torch.uint8).random_(0, 64)
                cache.parts[1].fill_(0.01)
            else:
                cache.tensor.normal_()
        times: dict[str, list[float]] = {name: [] for name in runners}
        for rep in range(reps + 1):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.logits(chunks)
                if rep:  # the first rep warms up
                    times[name].append(time.perf_counter() - start)
        out[(batch, context)] = {name: statistics.median(t) for name, t in times.items()}
        for runner in runners.values():
            runner.kv_cache.close()
            runner.kv_cache = None
        gc.collect()
        shown = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in out[(batch, context)].items())
        print(f"  step {batch} x {context}: {shown}", flush=True)
    return out


# ---- quality ---------------------------------------------------------------------------------------------------

def nll(runner: ModelRunner, ids: list[int]) -> float:
    blocks = -(-len(ids) // runner.block_size)
    runner.allocate_kv_cache(blocks)
    _, hidden = runner.logits_with_prompt([SequenceChunk(ids, 0, list(range(blocks)))], full_logits=[0])
    logprobs = torch.log_softmax(runner.project(hidden[0]).float(), dim=-1)
    return float(-logprobs[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).mean())


def agreement(ref: ModelRunner, runner: ModelRunner, prompts: list[list[int]], steps: int = 32) -> tuple[float, float]:
    """Teacher-forced on the reference's greedy answer: the share of steps whose next token equals it, all and sure."""
    agree, sure_agree, sure = 0, 0, 0
    for ids in prompts:
        blocks = -(-(len(ids) + steps) // ref.block_size)
        table = list(range(blocks))
        ref.allocate_kv_cache(blocks)
        answer, margins = [], []
        logits = ref.logits([SequenceChunk(ids, 0, table)])
        for i in range(steps):
            top = logits[0].float().topk(2).values
            answer.append(int(logits[0].argmax()))
            margins.append(float(top[0] - top[1]))
            logits = ref.logits([SequenceChunk([answer[-1]], len(ids) + i, table)])
        runner.allocate_kv_cache(blocks)
        logits = runner.logits([SequenceChunk(ids, 0, table)])
        for i in range(steps):
            ok = int(logits[0].argmax()) == answer[i]
            agree += ok
            if margins[i] >= 1.0:
                sure += 1
                sure_agree += ok
            logits = runner.logits([SequenceChunk([answer[i]], len(ids) + i, table)])
    return agree / (steps * len(prompts)), sure_agree / max(sure, 1)


def scale_errors(ref: ModelRunner, ids: list[int]) -> dict[str, tuple[float, float]]:
    """Relative RMS error of K and V (all layers) per 8-bit format: (per token-head scales, per block-head scales)."""
    blocks = -(-len(ids) // ref.block_size)
    cache = ref.allocate_kv_cache(blocks)
    ref.logits([SequenceChunk(ids, 0, list(range(blocks)))])
    kv = torch.stack([layer[:blocks].float() for layer in cache.layers])  # [layers, blocks, 2, bs, heads, d]
    full_blocks = len(ids) // ref.block_size
    kv = kv[:, :full_blocks]
    out = {}
    for name, code in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8)):
        per_token = kv_codes.decode(*kv_codes.encode(kv, code), torch.float32)
        # one scale per (block, K/V, head): the block's tokens and dims share it
        x = kv.permute(0, 1, 2, 4, 3, 5)  # [layers, blocks, 2, heads, bs, d]
        flat = x.flatten(-2)
        per_block = kv_codes.decode(*kv_codes.encode(flat, code), torch.float32).view_as(x).permute(0, 1, 2, 4, 3, 5)

        def rel(y: torch.Tensor) -> float:
            return float((y - kv).pow(2).sum().sqrt() / kv.pow(2).sum().sqrt())

        out[name] = (rel(per_token), rel(per_block))
    return out


# ---- PD ------------------------------------------------------------------------------------------------------

def pd_transfer(kv_dtype: str, prompts: list[list[int]], log_dir: Path) -> tuple[float, float, float]:
    """Through a 1P1D launch, one prompt at a time: (KV bytes D received per prompt token, the median span from
    P's first layer written to D told the prefill is done (the layers go out while P computes), and the median
    tail after P's last layer was written), in ms."""
    command = [sys.executable, "-m", "pdserve.cli", "launch", "--prefill", "1", "--decode", "1", "--port", "{port}",
               "--pd-policy", "always",
               "--kv-cache-dtype", kv_dtype, "--kv-cache-memory", "2G", "--max-model-len", "2048",
               "--max-num-batched-tokens", "2048"]
    per_token, spans, tails = [], [], []
    with served(f"launch {kv_dtype}", command, {}, log_dir / f"launch-{kv_dtype}.log") as url:
        for ids in prompts:
            r = httpx.post(f"{url}/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": 4, "temperature": 0,
                "collect_metrics": True}, timeout=300).json()
            m = r.get("metrics", {})
            if "kv_bytes" not in m:  # not computed by the prefill instance (a retry, an error): said, not counted
                print(f"  PD {kv_dtype}: a response without KV bytes: {r}", flush=True)
                continue
            per_token.append(m["kv_bytes"] / r["usage"]["prompt_tokens"])
            spans.append(m["prefill_done_received"] - m["first_layer_written"])
            tails.append(m["prefill_done_received"] - m["last_layer_written"])
    return statistics.mean(per_token), statistics.median(spans) * 1e3, statistics.median(tails) * 1e3


# ---- report ----------------------------------------------------------------------------------------------------

def speed_only(runners: dict[str, ModelRunner], names: list[str], args: argparse.Namespace, lines: list[str]) -> None:
    cap, steps = capacity(runners), step_times(runners, args.reps)
    ref_name = names[0]
    header = " | ".join(f"step {b}x{c} ms (x ref)" for b, c in SHAPES)
    lines += [f"Model {args.model}; reference KV cache: {ref_name}.", "",
              f"| KV dtype | tokens in 2 GiB | x ref | {header} |", "|---|---|---|" + "---|" * len(SHAPES)]
    for n in names:
        cells = [f"{steps[shape][n] * 1e3:.1f} ({steps[shape][ref_name] / steps[shape][n]:.2f}x)" for shape in SHAPES]
        lines.append(f"| {n} | {cap[n]:,} | {cap[n] / cap[ref_name]:.2f} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="auto,fp8,int8", help="KV cache dtypes, the first the reference")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-pd", action="store_true", help="skip the 1P1D transfers")
    ap.add_argument("--out", type=Path, help="also write the report here (markdown)")
    ap.add_argument("--model", help="another model (a .gguf or HF folder): capacity and steps only (the files "
                    "bench/quantized.py writes have random weights: no quality to measure)")
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES), help="decode steps, BATCHxCONTEXT")
    args = ap.parse_args()
    SHAPES[:] = [(int(b), int(c)) for b, c in (x.split("x") for x in args.shapes.split(","))]
    names = args.dtypes.split(",")
    lines = [f"Machine: {machine()}", ""]
    runners = {n: ModelRunner(args.model, dtype="auto", device="cpu", max_model_len=8192, kv_cache_dtype=n)
               for n in names}
    ref_name = names[0]
    ref = runners[ref_name]
    cache_dtype = {n: r.layout(1).dtype for n, r in runners.items()}
    print(f"model {args.model or 'embedded'}, dtype {ref.dtype}; KV: {cache_dtype}", flush=True)
    if args.model:
        speed_only(runners, names, args, lines)
        return

    texts = sharegpt_texts(200)
    tok = Tokenizer(resolve_model_folder(None))
    held_out: list[int] = []
    for t in texts[100:]:
        held_out += tok.encode(t)
        if len(held_out) >= 2000:
            break
    held_out = held_out[:2000]
    prompts = [ids[:200] for t in texts[:40] if len(ids := tok.encode(t)) >= 64][:8]
    long_prompts: list[list[int]] = []
    buf: list[int] = []
    for t in texts[40:100]:
        buf += tok.encode(t)
        if len(buf) >= 1000:
            long_prompts.append(buf[:1000])
            buf = []
        if len(long_prompts) == 8:
            break

    cap = capacity(runners)
    steps = step_times(runners, args.reps)
    nlls = {n: nll(r, held_out) for n, r in runners.items()}
    agree = {n: agreement(ref, r, prompts) for n, r in runners.items() if n != ref_name}
    errors = scale_errors(ref, held_out)
    pd: dict[str, tuple[float, float, float]] = {}
    if not args.no_pd:
        with tempfile.TemporaryDirectory() as tmp:
            for n in names:
                pd[n] = pd_transfer(n, long_prompts, Path(tmp))
                print(f"  PD {n}: {pd[n][0]:.0f} bytes/token, span {pd[n][1]:.1f} ms, tail {pd[n][2]:.1f} ms",
                      flush=True)

    lines += [f"Model dtype {str(ref.dtype).removeprefix('torch.')}; reference KV cache: {ref_name} "
              f"({cache_dtype[ref_name]}).", "",
              "| KV dtype | tokens in 2 GiB | x ref | " + " | ".join(f"step {b}x{c} ms (x ref)" for b, c in SHAPES)
              + " | NLL (vs ref) | agree all / sure | PD bytes/token (x ref) | PD span / tail ms |",
              "|---|---|---|" + "---|" * len(SHAPES) + "---|---|---|---|"]
    for n in names:
        row = [f"{n} ({cache_dtype[n]})", f"{cap[n]:,}", f"{cap[n] / cap[ref_name]:.2f}"]
        for shape in SHAPES:
            t, t0 = steps[shape][n], steps[shape][ref_name]
            row.append(f"{t * 1e3:.1f} ({t0 / t:.2f}x)")
        row.append(f"{nlls[n]:.4f} ({nlls[n] / nlls[ref_name] - 1:+.2%})")
        row.append("-" if n == ref_name else f"{agree[n][0]:.0%} / {agree[n][1]:.0%}")
        if pd:
            row += [f"{pd[n][0]:.0f} ({pd[n][0] / pd[ref_name][0]:.2f}x)", f"{pd[n][1]:.0f} / {pd[n][2]:.1f}"]
        else:
            row += ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Scale granularity (relative RMS error of K and V, all layers, on the held-out text):", "",
              "| format | per (token, head): pdserve | per (64-token block, head) |", "|---|---|---|"]
    for name, (tok_err, block_err) in errors.items():
        lines.append(f"| {name} | {tok_err:.4f} | {block_err:.4f} |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
