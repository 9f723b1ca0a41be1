"""A KV cache's bytes in a named shared-memory segment, without torch.

The worker views a segment as the cache tensor (`kv/cache.py`); the cache service only moves its
bytes, so it maps the segment through this module and never imports torch. Names are
`pdserve-kv-<creator pid>-<random>`: `utils/stale_ipc.py` removes those whose creator is gone.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory

from pdserve.utils.shm_room import check_room

_created_here: set[str] = set()


def create_segment(nbytes: int) -> shared_memory.SharedMemory:
    """A new segment; pages are not touched, so memory is used only as far as the cache fills. Refused
    (SharedMemoryFull) when /dev/shm could not hold it filled."""
    check_room(nbytes)
    name = f"pdserve-kv-{os.getpid()}-{secrets.token_hex(4)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    _created_here.add(name)
    return shm


def attach_segment(name: str, min_bytes: int = 0) -> shared_memory.SharedMemory:
    """Map a segment another process owns, without Python 3.11's resource tracker adopting it
    (it would unlink the segment when this process exits)."""
    shm = shared_memory.SharedMemory(name=name)
    if shm.size < min_bytes:
        shm.close()
        raise ValueError(f"shared-memory segment {name} holds {shm.size} bytes, less than the cache's {min_bytes}")
    if name in _created_here:  # ours: the tracker's one registration is the creator's, keep it
        return shm
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass
    return shm


def release_segment(shm: shared_memory.SharedMemory, owner: bool) -> None:
    """Drop this process's mapping; the creating process also removes the segment."""
    try:
        shm.close()
    except BufferError:  # a view of the buffer is still alive somewhere; the OS unmaps at exit
        pass
    if owner:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class KVSegment:
    """The cache service's handle on the cache: the segment, whether this process created it."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self.shm: shared_memory.SharedMemory | None = shm
        self.owner = owner
        self.name = shm.name

    @classmethod
    def create(cls, nbytes: int) -> KVSegment:
        return cls(create_segment(nbytes), owner=True)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> KVSegment:
        return cls(attach_segment(name, nbytes), owner=False)

    def close(self) -> None:
        if self.shm is not None:
            release_segment(self.shm, self.owner)
            self.shm = None
