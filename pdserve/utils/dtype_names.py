"""Which dtype `--dtype auto` and `--kv-cache-dtype auto` pick, by name and without torch where that is
possible: the engine describes the cache layout before any worker exists (the cache-first rows of
the startup table), and the engine process does not load torch. The worker decides with torch
(`model/load.py`); the engine checks that the worker's layout equals the one it made.
"""

from __future__ import annotations

import glob
import os

from pdserve.utils.cpu_features import cpu_flags

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def gpu_present() -> bool:
    """An NVIDIA or AMD device node: a GPU torch may pick (torch itself answers only once loaded)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def cpu_auto_dtype() -> str:
    """AVX512_BF16 or AMX: bf16; elsewhere fp32 (model/load.py's cpu_has_native_bf16, from the flags)."""
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "float32"


def cpu_kv_cache_dtype(device: str | None, dtype: str, kv_cache_dtype: str) -> str | None:
    """The KV cache dtype's name on a CPU-only run; None where only torch can tell (a GPU, an odd name)."""
    if (device or ("cuda" if gpu_present() else "cpu")).split(":")[0] != "cpu":
        return None
    model = cpu_auto_dtype() if dtype == "auto" else dtype
    name = model if kv_cache_dtype == "auto" else kv_cache_dtype
    return name if name in DTYPE_NAMES else None
