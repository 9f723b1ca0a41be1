"""The host and disk tiers' upkeep between steps: saves that finished give their device blocks back, disk writes
that finished become readable, and a clean stop writes what the disk lacks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from pdserve.engine.block_copies import BlockCopies
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import CacheService
from pdserve.kv.disk_writer import QUEUE_BYTES

log = logging.getLogger("pdserve.engine")

DISK_DUMP_S = 8.0  # a clean stop's writes to the disk tier, at most (the API server waits 15 s for the engine)


class TierUpkeep:
    def __init__(self, kv: KVCacheManager, copies: BlockCopies, cache_service: CacheService, block_bytes: int,
                 run_copies: Callable[[], None]) -> None:
        self.kv = kv
        self.copies = copies
        self.cache_service = cache_service
        self.block_bytes = block_bytes
        self.run_copies = run_copies  # a step with no chunks: carries the queued copies to the worker

    def poll(self) -> None:
        """Saves to the host tier that completed give their device blocks back; disk writes that finished
        make their blocks readable from the disk tier."""
        if self.kv.host is not None:
            for save_id, host_blocks in self.copies.blocks_saved():
                self.kv.saved(save_id, host_blocks)
        if self.kv.disk is not None and (done := self.copies.disk_written()) != ([], []):
            self.kv.disk_written(*done)

    def write_to_disk_at_stop(self, timeout: float = DISK_DUMP_S) -> None:
        """A clean stop with a disk tier: the prefix blocks of the device cache and the host tier that the disk
        lacks are written, for `timeout` seconds at most, so that a restart comes back with all it had."""
        if self.kv.disk is None:
            return
        start = time.monotonic()
        ordered: set[bytes] = set()
        queue = QUEUE_BYTES // self.block_bytes  # what the cache service's writer takes at once
        while time.monotonic() - start < timeout:
            more = self.kv.write_tiers_to_disk(ordered, queue // 2 - self.kv.disk_writes_in_flight)
            if not more and not self.kv.saves_in_flight and not self.kv.disk_writes_in_flight:
                break
            self._wait(self.cache_service.sockets)
        left = self.kv.saves_in_flight + self.kv.disk_writes_in_flight
        log.info("disk KV tier: %d blocks the disk lacked ordered written at stop, in %.1f s%s", len(ordered),
                 time.monotonic() - start, f"; {left} unfinished when the time ran out" if left else "")

    def wait_for_host_saves(self, timeout: float = 10.0) -> None:
        """Until no device block is held for a copy to the host tier (they are seconds at most)."""
        deadline = time.monotonic() + timeout
        while self.kv.saves_in_flight and time.monotonic() < deadline:
            self._wait(self.copies.sockets)

    def finish_copies(self) -> None:
        """Every queued copy carried out (the aborts' host-tier saves before the cache memory goes)."""
        while self.copies.pending:
            self.run_copies()
        self.poll()

    def _wait(self, sockets: list[zmq.Socket]) -> None:
        if self.copies.pending:
            self.run_copies()
        else:
            zmq.select(sockets, [], [], 0.05)
        self.poll()
