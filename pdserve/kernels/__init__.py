"""pdserve's compiled CPU kernels (paged attention and KV writes; RoPE, SwiGLU and RMSNorm; the tensor-parallel
ranks' shared-memory all-reduce; linears on oneDNN's packed and on GGUF's quantized weights), built once
per CPU, torch version and source.

`make venv` builds them (`python -m pdserve.kernels`); a process that finds no build tries once
itself. If the compiler or ninja is missing, or the build fails, `cpu_ops()` returns None, says so once
in the log, and the model falls back to gathering K/V and calling torch's SDPA.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.config.model import ModelConfig
from pdserve.utils.cpu_features import cpu_flags

log = logging.getLogger("pdserve.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "fused_ops.cpp", CSRC / "shm_all_reduce.cpp",
           CSRC / "few_row_linear.cpp", CSRC / "quant_linear.cpp"]
# -Wno-psabi: on AVX2 the 16-float vector type is passed in two registers; GCC warns about that ABI.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]
_DISABLE_ENV = "PDSERVE_DISABLE_KERNELS"  # "1": behave as if the build had failed (tests, comparisons)
# Build for less than this CPU has, so one machine tests the paths of smaller ones: "avx2" leaves out every
# AVX-512 instruction (8-float vectors, no bf16 dot products). Pair it with ONEDNN_MAX_CPU_ISA=AVX2 so oneDNN
# packs and multiplies as it would there too.
ISA_ENV = "PDSERVE_KERNEL_ISA"
_ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}


def cflags() -> list[str]:
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in _ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: choose one of {', '.join(_ISA_FLAGS)}")
    return CFLAGS + _ISA_FLAGS[isa]


def build_tag() -> str:
    """Sources, flags, torch version and CPU features: the build uses -march=native, so a new CPU means a
    new build. Also the sources' folder: torch's builder rebuilds when a build's source paths change, so two
    checkouts sharing one tag rebuilt each other's library back and forth, under each other's running processes."""
    h = hashlib.sha256()
    h.update(str(CSRC.resolve()).encode())
    for path in sorted(CSRC.iterdir()):
        h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(cflags()).encode())
    h.update(platform.machine().encode())
    h.update(" ".join(sorted(cpu_flags())).encode())
    return h.hexdigest()[:16]


def build_dir(tag: str) -> Path:
    from pdserve.loader.gguf_convert import cache_root

    return cache_root() / "kernels" / tag


def build(verbose: bool = False) -> Path:
    """Compile (tens of seconds) or, when this tag was built before, just load the library; its folder."""
    from torch.utils import cpp_extension

    tag = build_tag()
    folder = build_dir(tag)
    folder.mkdir(parents=True, exist_ok=True)
    _drop_stale_lock(folder / "lock")
    cpp_extension.load(
        name=f"pdserve_kernels_{tag}",
        sources=[str(p) for p in SOURCES],
        extra_cflags=cflags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=verbose,
    )
    return folder


def _drop_stale_lock(lock: Path, max_age: float = 600.0) -> None:
    """torch's builder waits for as long as its lock file exists; a build killed midway leaves it behind."""
    try:
        if time.time() - lock.stat().st_mtime > max_age:
            lock.unlink()
            log.warning("removed a stale kernel build lock (%s); building again", lock)
    except FileNotFoundError:
        pass


@functools.cache
def cpu_ops() -> Any | None:
    """torch.ops.pdserve_kernels, or None when the kernels cannot be had here (logged once)."""
    if os.environ.get(_DISABLE_ENV) == "1":
        log.info("compiled CPU kernels disabled by %s=1: attention gathers K/V and calls SDPA", _DISABLE_ENV)
        return None
    try:
        build()
    except Exception as e:  # noqa: BLE001 - any build failure means: run on the fallback path
        last = str(e).strip().splitlines()[-1:] or [type(e).__name__]
        log.warning("pdserve's CPU attention kernel could not be built (%s); running on the slower "
                    "gather + SDPA path. `python -m pdserve.kernels` shows the whole build log.", last[0])
        return None
    return torch.ops.pdserve_kernels


def kernels_for(config: ModelConfig, device: torch.device) -> Any | None:
    """The CPU kernels when they are built and take this model's shapes (multiples of 16); else None."""
    if device.type != "cpu" or config.head_dim > 256:
        return None
    if any(n % 16 for n in (config.head_dim, config.hidden_size, config.intermediate_size)):
        return None
    return cpu_ops()
