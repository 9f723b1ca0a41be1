"""The engine's queue of block copies for a worker whose KV cache is in device memory.

With a shared-memory cache the cache service copies between the cache and its host segments itself;
with a device cache only the worker can reach the cache, so the same copies ride with the worker's next
step (`ExecuteStep.copies`) and run before its forward pass. This queue is then the instance's
BlockCopies (block_copies.py): the host tier's copier and the decode buffer's swapper, and it copies
what P wrote into D's staging area into D's cache.

Ordering is what makes it correct: the next step that can read a block is the one that carries its copy,
and the worker runs copies first, in queue order. A copy the engine must see completed before it frees
memory (a host-tier save releases its device blocks, a swap-in frees its buffer blocks) is reported in
that step's result.

The disk tier's files are the cache service's: a save with disk keys goes on to it once the worker has copied
the blocks into the host segment the service maps, and disk reads land there too.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.worker.protocol import DEVICE, BlockCopy

if TYPE_CHECKING:
    import zmq

    from pdserve.engine.kv_connector import CacheService
    from pdserve.engine.prefix_loads import LoadResult


class WorkerCopies:

    def __init__(self, block_bytes: int, service: CacheService | None = None) -> None:
        self.block_bytes = block_bytes
        self.service = service  # the disk tier's files
        self._ids = itertools.count()
        self._queue: list[BlockCopy] = []
        self._on_done: dict[int, Callable[[], None]] = {}
        self._saved: list[tuple[int, list[int]]] = []
        self._swapped: list[tuple[str, int, float]] = []

    @property
    def sockets(self) -> list[zmq.Socket]:
        """Completed copies are reported with the step that ran them; disk reads and pulls by the cache service."""
        return self.service.sockets if self.service is not None else []

    @property
    def pending(self) -> bool:
        """Copies wait for a step: the engine sends one even when nothing is scheduled."""
        return bool(self._queue)

    def take(self) -> list[BlockCopy]:
        """The copies for the step about to be sent."""
        out, self._queue = self._queue, []
        return out

    def done(self, copy_ids: list[int]) -> None:
        """The worker completed these copies."""
        for copy_id in copy_ids:
            if (callback := self._on_done.pop(copy_id, None)) is not None:
                callback()

    # ---- the host tier ----

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None:
        def saved() -> None:
            self._saved.append((save_id, host_blocks))
            if any(disk_keys) or hashes:
                self._disk().host_blocks_filled(host_blocks, list(disk_keys), list(hashes))

        self._add(DEVICE, "host", device_blocks, host_blocks, saved)

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self._add("host", DEVICE, host_blocks, device_blocks)  # read first by the step that carries it

    def blocks_saved(self) -> list[tuple[int, list[int]]]:
        out, self._saved = self._saved, []
        return out

    # ---- the disk tier (the cache service's files, through the host segment) ----

    def write_to_disk(self, keys: list[bytes], host_blocks: list[int]) -> None:
        self._disk().write_to_disk(keys, host_blocks)

    def disk_written(self) -> tuple[list[bytes], list[bytes]]:
        return self.service.disk_written() if self.service is not None else ([], [])

    def start_load_from_disk(self, load_id: str, keys: list[bytes], host_blocks: list[int]) -> None:
        self._disk().start_load_from_disk(load_id, keys, host_blocks)

    def remove_from_disk(self, keys: list[bytes]) -> None:
        self._disk().remove_from_disk(keys)

    def start_pull(self, load_id: str, addr: str, hashes: list[bytes], host_blocks: list[int],
                   deadline: float) -> None:
        self._disk().start_pull(load_id, addr, hashes, host_blocks, deadline)

    def loads_done(self) -> list[LoadResult]:
        return self.service.loads_done() if self.service is not None else []

    def forget_host_blocks(self) -> None:
        if self.service is not None:
            self.service.forget_host_blocks()

    def _disk(self) -> CacheService:
        if self.service is None:
            raise RuntimeError("the disk tier and prefix pulls need the cache service (--swap-space starts it)")
        return self.service

    # ---- the decode side ----

    def swap_in(self, transfer_id: str, buffer_blocks: list[int], cache_blocks: list[int]) -> None:
        """Decode buffer -> cache; reported by swaps_done once the worker has copied it."""
        started = time.perf_counter()
        nbytes = len(buffer_blocks) * self.block_bytes
        self._add("buffer", DEVICE, buffer_blocks, cache_blocks,
                  lambda: self._swapped.append((transfer_id, nbytes, time.perf_counter() - started)))

    def swaps_done(self) -> list[tuple[str, int, float]]:
        """(transfer id, bytes, seconds from order to completion) of the swap-ins completed since the last call."""
        out, self._swapped = self._swapped, []
        return out

    def stage_in(self, blocks: list[int]) -> None:
        """What P wrote into D's staging area (which mirrors the cache's block ids) -> the same cache blocks."""
        self._add("staging", DEVICE, blocks, blocks)

    def _add(self, src: str, dst: str, src_blocks: list[int], dst_blocks: list[int],
             on_done: Callable[[], None] | None = None) -> None:
        if not src_blocks:
            if on_done is not None:
                on_done()
            return
        copy_id = next(self._ids)
        self._queue.append(BlockCopy(copy_id, src, dst, list(src_blocks), list(dst_blocks)))
        if on_done is not None:
            self._on_done[copy_id] = on_done
