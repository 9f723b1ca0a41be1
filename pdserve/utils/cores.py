"""Splitting the cores a process may use among its ranks (data-parallel engines, tensor-parallel workers):
contiguous shares, so ranks never share a core when there are enough; all of them each when there are not."""

from __future__ import annotations

import os


def core_share(cores: list[int], rank: int, ranks: int) -> list[int]:
    """Rank `rank`'s contiguous share of `cores` (all of them when there are fewer cores than ranks)."""
    if len(cores) < ranks:
        return cores
    per, extra = divmod(len(cores), ranks)
    start = rank * per + min(rank, extra)
    return cores[start:start + per + (rank < extra)]


def my_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def visible_gpus() -> list[str]:
    """The GPUs a child may be given (CUDA_VISIBLE_DEVICES' entries, else one per NVIDIA device node), without
    torch: a data-parallel rank's engine gets its own through CUDA_VISIBLE_DEVICES."""
    import glob
    import re

    if (given := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [g.strip() for g in given.split(",") if g.strip()]
    nodes = [re.search(r"(\d+)$", p) for p in glob.glob("/dev/nvidia[0-9]*")]
    return sorted((m.group(1) for m in nodes if m), key=int)
