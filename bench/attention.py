"""Paged attention on the CPU: pdserve's compiled kernel beside the gather + SDPA path it replaced,
and beside the memory-bandwidth floor, in one run.

    .venv/bin/python bench/attention.py [--dtypes bfloat16,float32] [--reps 10]

Each row is one layer's attention call as the model makes it (K/V written into the cache, then
attention over the paged blocks), for a decode step of N sequences at one context length, and for
one fresh prefill. The geometry is the embedded model's: 9 query heads over 3 KV heads of 64, blocks
of 64 tokens, scattered over the cache. The floor is the bytes of K/V read divided by the memcpy
rate measured at the start of the run (bytes copied per second, 2 threads).
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.kernels import cpu_ops
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model import ForwardBatch, SequenceChunk
from pdserve.model.paged_attention import GatherBuffers, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 64


def seconds(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def memcpy_rate() -> float:
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    return src.numel() * 4 / seconds(lambda: dst.copy_(src), 10)


def case(dtype: torch.dtype, seqs: int, context: int, queries: int, reps: int, rate: float) -> tuple[float, ...]:
    per_seq = -(-context // BLOCK)
    num_blocks = seqs * per_seq + 1
    spec = KVLayout(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, str(dtype).removeprefix("torch."))
    cache = KVCache.allocate(spec, "cpu")
    cache.tensor.normal_()
    order = torch.randperm(num_blocks - 1).tolist()  # scattered blocks, as after some churn
    chunks = [SequenceChunk([0] * queries, context - queries, order[i * per_seq:(i + 1) * per_seq])
              for i in range(seqs)]
    tokens = seqs * queries
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    buffers = GatherBuffers()
    timings = []
    for fallback in (False, True):
        batch = ForwardBatch.build(chunks, BLOCK, with_fallback=fallback)
        timings.append(seconds(lambda b=batch: paged_attention(q, k, v, cache.layers[1], b, HEAD_DIM ** -0.5,
                                                               buffers), reps))
    floor = seqs * context * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize / rate
    return timings[0], timings[1], floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if cpu_ops() is None:
        raise SystemExit("the compiled kernel is not built here: run `python -m pdserve.kernels` to see why")
    rate = memcpy_rate()
    print(f"memcpy {rate / 1e9:.1f} GB/s; one layer's attention call, ms (mean of {args.reps} calls)\n")
    print("| dtype | step | seqs | context | kernel | gather + SDPA | floor | SDPA / kernel | kernel / floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        shapes = [("decode", s, c, 1) for s in (1, 8, 64) for c in (128, 512, 1024, 4096) if s * c <= 64 * 1024]
        shapes += [("prefill", 1, n, n) for n in (128, 512, 2048)]
        for kind, seqs, context, queries in shapes:
            kernel, sdpa, floor = case(dtype, seqs, context, queries, args.reps, rate)
            print(f"| {name} | {kind} | {seqs} | {context} | {kernel * 1e3:.3f} | {sdpa * 1e3:.3f} | "
                  f"{floor * 1e3:.3f} | {sdpa / kernel:.2f}x | {kernel / floor:.2f} |")


if __name__ == "__main__":
    main()
