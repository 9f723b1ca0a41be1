"""A pytest-xdist worker's own /dev/shm.

Tests check that servers leave no shared-memory segment behind by comparing /dev/shm before and after. With
several xdist workers, another worker's servers would come and go in the same folder; each worker therefore
runs in a mount namespace of its own with a fresh tmpfs on /dev/shm, which every process it starts inherits.
Serial runs (no PYTEST_XDIST_WORKER) keep the host's /dev/shm.
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
WORKER = "PYTEST_XDIST_WORKER"


def enter_private_shm() -> str:
    """For an xdist worker: a new mount namespace whose /dev/shm is an empty tmpfs of the host's size. What the
    worker's /dev/shm is, in words."""
    worker = os.environ.get(WORKER)
    if not worker:
        return "the host's"
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.statvfs("/dev/shm")
    size_bytes = size.f_blocks * size.f_frsize
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"xdist worker {worker}: no mount namespace of its own "
                      f"({os.strerror(ctypes.get_errno())}); run the suite without -n")
    for source, target, kind, flags, data in ((b"none", b"/", None, MS_REC | MS_PRIVATE, None),
                                              (b"tmpfs", b"/dev/shm", b"tmpfs", 0, f"size={size_bytes}".encode())):
        if libc.mount(source, target, kind, flags, data) != 0:
            raise OSError(ctypes.get_errno(), f"xdist worker {worker}: mounting {target.decode()} failed "
                          f"({os.strerror(ctypes.get_errno())})")
    return f"a tmpfs of its own (xdist worker {worker})"
