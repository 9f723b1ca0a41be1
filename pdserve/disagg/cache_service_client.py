"""The engine's handle on its cache service process (engine/kv_connector.py's CacheService)."""

from __future__ import annotations

import zmq

from pdserve.config import EngineConfig
from pdserve.disagg.messages import (
    AttachCache,
    CacheServiceReady,
    CreateCache,
    DetachCache,
    ExtendDeadline,
    ReceiverStats,
    ServiceError,
    ServiceMessage,
    ServiceShutdown,
    SwapDone,
    SwapIn,
    TransferDone,
)
from pdserve.kv_layout import KVLayout
from pdserve.utils.child_process import ChildDied, ChildProcess


class CacheServiceClient:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, address: str, messager_address: str) -> None:
        self.child = ChildProcess("cache service", "pdserve.disagg.cache_service",
                                  ["--config", config.encode(), "--messager-address", messager_address],
                                  ctx, address, ServiceMessage)
        self.proc = self.child.proc
        self.refused_connections = 0  # decode side: KV connections its receivers refused
        self._attached_to_worker = False  # mixed role: the worker owns the cache, the service attached to it

    @property
    def sock(self) -> zmq.Socket:
        return self.child.sock

    def setup(self, command: CreateCache | AttachCache, timeout: float) -> CacheServiceReady:
        self.child.send(command)
        what = "create the KV cache" if isinstance(command, CreateCache) else "attach to the KV cache"
        msg = self.child.receive(timeout, what=what)
        if isinstance(msg, ServiceError):
            raise ChildDied(msg.error)
        assert isinstance(msg, CacheServiceReady)
        self._attached_to_worker = isinstance(command, AttachCache)
        return msg

    def worker_cache_freed(self) -> None:
        if self._attached_to_worker:  # the memory goes only when both let go
            self.child.send(DetachCache())

    def worker_cache_created(self, layout: KVLayout, segment: str | None) -> None:
        if self._attached_to_worker and segment is not None:
            self.child.send(AttachCache(layout, segment))

    def extend_deadline(self, transfer_id: str, deadline: float) -> None:
        self.child.send(ExtendDeadline(transfer_id, deadline))

    def swap_in(self, transfer_id: str, buffer_blocks: list[int], cache_blocks: list[int]) -> None:
        self.child.send(SwapIn(transfer_id, buffer_blocks, cache_blocks))

    def transfer_reports(self) -> list[TransferDone | SwapDone]:
        """What the service sent since the last call: transfer and swap reports (returned), receiver
        stats (kept)."""
        out: list[TransferDone | SwapDone] = []
        while (msg := self.child.receive_nowait()) is not None:
            if isinstance(msg, TransferDone | SwapDone):
                out.append(msg)
            elif isinstance(msg, ReceiverStats):
                self.refused_connections = msg.refused_connections
        return out

    def alive(self) -> bool:
        return self.child.alive()

    def exit_code(self) -> int | None:
        return self.proc.returncode

    def shutdown(self, timeout: float = 10.0) -> None:
        self.child.shutdown(ServiceShutdown(), timeout)
