"""Writes to the disk tier on a thread of their own, so a slow disk never holds up the cache service's loop
(the prefill messager's transfers, the host tier's copies, the engine's loads).

A block is queued as a private copy of its bytes: the host block it came from may be reused at once. The queue
is bounded in bytes; a block that finds it full is not written (reported failed: it stays in memory only). The
outcome of each write is collected by `results()`, which the loop reports to the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from pdserve.kv.disk_store import DiskFiles

log = logging.getLogger("pdserve.kv.disk")

QUEUE_BYTES = 256 * 2**20  # queued block copies at most; past it writes are dropped
WARN_EVERY_S = 10.0


class DiskWriter:
    def __init__(self, files: DiskFiles, max_queued_bytes: int = QUEUE_BYTES) -> None:
        self.files = files
        self.max_queued = max(1, max_queued_bytes // files.block_bytes)
        self.dropped = 0  # blocks not written because the queue was full
        self._warned_at, self._warned_count = float("-inf"), 0
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._done: list[tuple[bytes, bool]] = []
        self._lock = threading.Lock()
        self._queued = 0  # blocks queued and not yet written
        self._thread = threading.Thread(target=self._run, name="disk-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._queued > 0 or bool(self._done)

    def put(self, key: bytes, data: memoryview) -> None:
        """Queue a copy of `data` to be written under `key`."""
        with self._lock:
            full = self._queued >= self.max_queued
            if full:
                self.dropped += 1
                self._done.append((key, False))
            else:
                self._queued += 1
        if full:
            self._warn_dropped()
            return
        self._queue.put((key, bytes(data)))

    def _warn_dropped(self) -> None:
        """One line per burst of dropped writes (at most every WARN_EVERY_S), with how many."""
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("disk KV tier: %d blocks already wait to be written; %d more stay in memory only",
                        self.max_queued, self.dropped - self._warned_count)
            self._warned_at, self._warned_count = now, self.dropped

    def results(self) -> list[tuple[bytes, bool]]:
        """(key, written whole) of the writes finished since the last call."""
        with self._lock:
            out, self._done = self._done, []
        return out

    def close(self, timeout: float) -> int:
        """Finish the queued writes for up to `timeout` seconds, then stop; returns how many were left unwritten."""
        self._queue.put(None)
        self._thread.join(timeout)
        with self._lock:
            return self._queued

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, data = item
            try:
                self.files.write(key, data)
                ok = True
            except OSError as e:  # a full or failing disk loses the block, not the instance
                log.warning("disk KV tier: could not write a block (%s); it stays in memory only", e)
                ok = False
            with self._lock:
                self._queued -= 1
                self._done.append((key, ok))

    def wait_idle(self, timeout: float) -> bool:
        """Until every queued write has finished; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued == 0:
                    return True
            time.sleep(0.005)
        return False
