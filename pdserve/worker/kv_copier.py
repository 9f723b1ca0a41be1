"""Block copies between a KV cache in device memory and the cache service's host segments.

A worker whose cache is private to it (CUDA, or a CPU worker under PDSERVE_PRIVATE_KV_CACHE=1) moves KV
through host shared memory of the cache's block layout: P copies each finished layer device -> staging
before the messager may send it, D copies what P wrote (staging or the decode buffer) host -> device
before the request decodes, and the host prefix tier saves and loads whole blocks. Every copy is one
slice copy per run of adjacent blocks and returns an event; nothing is announced or read before its
event has completed.

On CUDA the copies run on a side stream that first waits for the compute stream, into page-locked memory
(cudaHostRegister on the segments), and the compute stream waits on a host -> device copy's event. On a
CPU they are synchronous (a completed event), unless the test hook PDSERVE_TEST_KV_COPY_DELAY (seconds)
delays each copy on a background thread: then a missing wait shows up as wrong output.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from pdserve.kv.cache import KVCache
from pdserve.kv.layout import block_runs
from pdserve.worker.protocol import DEVICE

log = logging.getLogger("pdserve.worker")
DELAY_ENV = "PDSERVE_TEST_KV_COPY_DELAY"


class CopyEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DoneEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FutureEvent:
    """A copy running on the test hook's background thread."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()


DONE = DoneEvent()


class KVCopier:
    def __init__(self, device_cache: Callable[[], KVCache], host: dict[str, KVCache], device: torch.device,
                 pin: bool = True) -> None:
        self._device_cache = device_cache  # the runner's current cache (it is freed and made again with the weights)
        self.host = host
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._registered: list[int] = []
        if self._stream is not None and pin and self._fits_pinned(host):  # pin=False: gpu_check's baseline
            for cache in host.values():
                self._pin(cache)
        self.delay = float(os.environ.get(DELAY_ENV, "0") or 0)
        slow = self.delay and self._stream is None
        self._slow = ThreadPoolExecutor(1, thread_name_prefix="kv-copy") if slow else None
        if self._slow is not None:
            log.warning("KV copies delayed by %g s each (%s, a test hook)", self.delay, DELAY_ENV)
        self._pending: list[CopyEvent] = []  # every call comes from the worker's compute thread

    def copy(self, src: str, dst: str, src_blocks: list[int], dst_blocks: list[int],
             layer: int | None = None) -> CopyEvent:
        """Blocks (one layer of them, or whole) from `src` to `dst` ("device" or a host segment's role)."""
        source, target = self._cache(src), self._cache(dst)
        runs = block_runs(src_blocks, dst_blocks)
        if layer is not None and self._stream is not None:
            # One layer of several blocks is strided; torch copies a strided tensor between a GPU and the
            # host through a pageable temporary, synchronously. Each block's layer is contiguous: one
            # asynchronous copy per block.
            runs = [(s + i, d + i, 1) for s, d, n in runs for i in range(n)]

        def run() -> None:
            for dst_part, src_part in zip(target.parts, source.parts, strict=True):  # an 8-bit cache: codes, scales
                for s, d, n in runs:
                    if layer is None:
                        dst_part[d:d + n].copy_(src_part[s:s + n], non_blocking=True)
                    else:
                        dst_part[d:d + n, layer].copy_(src_part[s:s + n, layer], non_blocking=True)

        event = self._launch(run)
        self._pending.append(event)
        return event

    def device_waits(self, event: CopyEvent) -> None:
        """What the compute stream runs next sees the copy's result (CUDA: a stream wait, no host sync)."""
        if self._stream is not None and isinstance(event, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(event)
        else:
            event.synchronize()

    def synchronize(self) -> None:
        """Every copy launched so far has completed."""
        pending, self._pending = self._pending, []
        for event in pending:
            event.synchronize()

    def close(self) -> None:
        self.synchronize()
        if self._slow is not None:
            self._slow.shutdown()
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered = []

    def _cache(self, role: str) -> KVCache:
        if role == DEVICE:
            return self._device_cache()
        cache = self.host.get(role)
        if cache is None:
            raise ValueError(f"this worker maps no {role!r} host segment (it has {sorted(self.host)})")
        return cache

    def _launch(self, run: Callable[[], None]) -> CopyEvent:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the K/V it reads are written
            with torch.cuda.stream(self._stream):
                run()
            event = torch.cuda.Event()
            event.record(self._stream)
            return event
        if self._slow is not None:
            delay = self.delay

            def slow() -> None:
                time.sleep(delay)
                run()

            return FutureEvent(self._slow.submit(slow))
        run()
        return DONE

    @staticmethod
    def _fits_pinned(host: dict[str, KVCache]) -> bool:
        """Page-locking makes every page of a segment resident (the staging area is as large as the device
        cache); where that would take most of the free RAM, copies stay pageable, which is slower but
        does not starve the machine."""
        import psutil

        nbytes = sum(c.tensor.numel() * c.tensor.element_size() for c in host.values())
        available = psutil.virtual_memory().available
        if nbytes <= 0.8 * available:
            return True
        log.warning("the host segments (%.1f GiB) would take most of the free RAM (%.1f GiB) if page-locked: "
                    "copies through them stay pageable (slower); lower --gpu-memory-utilization or "
                    "--num-gpu-blocks-override to pin them", nbytes / 2**30, available / 2**30)
        return False

    def _pin(self, cache: KVCache) -> None:
        """Page-lock a host segment so copies to and from it are asynchronous DMA (a pageable one makes
        `non_blocking` copies synchronous)."""
        ptr, nbytes = cache.tensor.data_ptr(), cache.tensor.numel() * cache.tensor.element_size()
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(getattr(err, "value", err)) != 0:
            log.warning("cudaHostRegister of %s (%d bytes) failed (error %s): copies through it are synchronous",
                        cache.shm_name, nbytes, err)
            return
        self._registered.append(ptr)
