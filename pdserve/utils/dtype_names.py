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
# The 8-bit KV cache dtypes (vLLM's names) and the torch dtype of their codes: each code is widened and
# multiplied by its (token, KV head)'s scale. `fp8` is e4m3.
KV_CODE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"}
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPE_CHOICES = ["auto", *DTYPE_NAMES, "fp8", *KV_CODE_DTYPES]


def kv_cache_dtype_name(kv_cache_dtype: str, model_dtype: str) -> str:
    """The cache dtype's one name: `auto` is the model's dtype, an alias its full name."""
    name = model_dtype if kv_cache_dtype == "auto" else KV_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in DTYPE_NAMES and name not in KV_CODE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return name


GPU_PRESENT_ENV = "PDSERVE_GPU_PRESENT"  # "1" / "0": say so instead of looking (tests; odd device setups)


def gpu_present() -> bool:
    """An NVIDIA or AMD device node: a GPU torch may pick (torch itself answers only once loaded)."""
    if (told := os.environ.get(GPU_PRESENT_ENV)) in ("0", "1"):
        return told == "1"
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX: bf16 matmuls run 2-4.5x faster than fp32 there (2-3.5x measured on Zen 4,
    3.5-4.5x on Zen 5); elsewhere bf16 is emulated (4-6x slower than fp32 on the AVX2 boxes). The one
    place this is decided: the worker (model/load.py) and the engine (below) must agree."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_auto_dtype() -> str:
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def cpu_kv_cache_dtype(device: str | None, dtype: str, kv_cache_dtype: str) -> str | None:
    """The KV cache dtype's name on a CPU-only run; None where only torch can tell (a GPU, an odd name)."""
    if (device or ("cuda" if gpu_present() else "cpu")).split(":")[0] != "cpu":
        return None
    model = cpu_auto_dtype() if dtype == "auto" else dtype
    if model not in DTYPE_NAMES:
        return None
    return kv_cache_dtype_name(kv_cache_dtype, model)
