"""The CPU's feature flags, as the kernel reports them (Linux /proc/cpuinfo; empty elsewhere)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_vnni() -> bool:
    """int8 dot products that accumulate straight into int32 (no int16 saturation)."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())

