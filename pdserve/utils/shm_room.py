"""How much a new shared-memory segment may take: /dev/shm's free space less what pdserve's segments
were promised and have not filled yet.

Segments are sparse: creating one costs no memory, filling it does. A write into a full /dev/shm (a
container's default is 64 MiB) kills the writer with SIGBUS mid-request, and two instances that each
sized their cache from the same free RAM fill more than there is. So a segment is refused at creation
when it cannot be filled, and the CPU profile run sizes the cache from the room really left.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

SHM = Path("/dev/shm")
SEGMENTS = "pdserve-kv-*"  # kv/segment.py's names


class SharedMemoryFull(OSError):
    pass


def unfilled(shm_dir: Path = SHM) -> int:
    """Bytes pdserve's existing segments may still fill (their size less what is resident)."""
    total = 0
    for path in shm_dir.glob(SEGMENTS):
        try:
            st = path.stat()
        except OSError:  # removed meanwhile
            continue
        total += max(st.st_size - st.st_blocks * 512, 0)
    return total


def shm_room(shm_dir: Path = SHM) -> int | None:
    """Bytes a new segment can fill without running /dev/shm out; None where there is no /dev/shm."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return max(st.f_bavail * st.f_frsize - unfilled(shm_dir), 0)


def free_host_memory() -> int:
    """RAM a CPU cache may fill: what is available less what pdserve's other (sparse) caches may still
    take, and no more than /dev/shm can hold. Sizing from the available RAM alone gave each of two
    instances on one machine nearly all of it."""
    free = psutil.virtual_memory().available - unfilled()
    room = shm_room()
    return max(min(free, room) if room is not None else free, 0)


def check_room(nbytes: int, shm_dir: Path = SHM) -> None:
    room = shm_room(shm_dir)
    if room is not None and nbytes > room:
        raise SharedMemoryFull(
            f"a {nbytes / 2**30:.2f} GiB shared-memory segment does not fit: {shm_dir} has {room / 2**30:.2f} GiB left "
            f"(its free space less what pdserve's other segments may still fill); filling it would kill the "
            f"process with SIGBUS. Ask for less (--kv-cache-memory, --num-gpu-blocks-override, "
            f"--gpu-memory-utilization, --swap-space, --splitwise-cache-buffer-size) or give {shm_dir} more "
            f"(in a container: docker run --shm-size=... or --ipc=host)")
