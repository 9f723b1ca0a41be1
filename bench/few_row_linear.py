"""The few-row linear kernel beside oneDNN's matmul on the same packed weights, per row count.

    .venv/bin/python bench/few_row_linear.py [--dtypes bfloat16,float32] [--rows 1,2,4,8,16,32,48] [--layers 30]

A decode step's linears: SmolLM2-135M's four per layer (qkv, o, gate|up, down) over --layers layers of distinct
weights, so they stream from memory as in a real step. Each row count times both paths alternately (best of 9)
and prints ms, the weights' read rate (GB/s) and oneDNN / kernel; beside them this box's read rate (a 512 MB
sum). `PDSERVE_KERNEL_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2` measures an AVX2 build on an AVX-512 box (fp32 only).
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.model.few_row_linear import max_rows
from pdserve.model.linear import PackedLinear
from pdserve.utils.cpu_features import cpu_flags

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best_of(runs: int, fns: dict) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def read_rate() -> float:
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    seconds = best_of(5, {"sum": lambda: x.sum()})["sum"]
    return x.numel() * 4 / seconds / 1e9


def run_dtype(dtype: torch.dtype, rows_list: list[int], layers: int) -> None:
    g = torch.Generator().manual_seed(0)
    stack = [[PackedLinear((torch.randn(n, k, generator=g) * 0.05).to(dtype), None) for n, k in SHAPES]
             for _ in range(layers)]
    if stack[0][0].few_rows is None:
        print(f"{dtype}: the kernel does not run here (see the start-up line in a server's log)")
        return
    nbytes = layers * sum(n * k for n, k in SHAPES) * torch.empty(0, dtype=dtype).element_size()
    print(f"\n{dtype}: {nbytes / 1e6:.0f} MB of weights; the kernel takes up to {max_rows(dtype)} rows\n")
    print("| rows | oneDNN ms | GB/s | kernel ms | GB/s | oneDNN / kernel |")
    print("|---|---|---|---|---|---|")
    for rows in rows_list:
        xs = [torch.randn(rows, k, generator=g).to(dtype) for _, k in SHAPES]

        def onednn(xs: list[torch.Tensor] = xs) -> None:
            for layer in stack:
                for x, lin in zip(xs, layer, strict=True):
                    torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")

        def kernel(xs: list[torch.Tensor] = xs) -> None:
            for layer in stack:
                for x, lin in zip(xs, layer, strict=True):
                    lin.few_rows(x)

        t = best_of(9, {"onednn": onednn, "kernel": kernel})
        print(f"| {rows} | {t['onednn'] * 1e3:.2f} | {nbytes / t['onednn'] / 1e9:.1f} | {t['kernel'] * 1e3:.2f} | "
              f"{nbytes / t['kernel'] / 1e9:.1f} | {t['onednn'] / t['kernel']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,2,4,8,16,32,48")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    print(f"# Few-row linears: {torch.get_num_threads()} threads, {' '.join(isa)}, torch {torch.__version__}")
    print(f"read rate (512 MB sum): {read_rate():.1f} GB/s")
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.dtypes.split(","):
        run_dtype(getattr(torch, name), rows, args.layers)


if __name__ == "__main__":
    main()
