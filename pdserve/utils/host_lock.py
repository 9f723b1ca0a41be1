"""A lock that the processes of one host (and one temporary folder) take in turn: an advisory `flock` on a
file under the temporary folder, released by the kernel when its holder exits, however it exits."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def host_lock(name: str, timeout: float) -> Iterator[float]:
    """Hold `pdserve-<name>.lock` for the block; yields the seconds waited for it. Past `timeout` the block runs
    without the lock (a hung holder must not stop a start)."""
    path = Path(tempfile.gettempdir()) / f"pdserve-{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    start = time.monotonic()
    try:
        held = False
        while not held and time.monotonic() - start < timeout:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                time.sleep(0.05)
        yield time.monotonic() - start
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
