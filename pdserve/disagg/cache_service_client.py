"""The engine's handle on its cache service process (engine/kv_connector.py's CacheService)."""

from __future__ import annotations

import zmq

from pdserve.config.engine import EngineConfig
from pdserve.disagg.messages import (
    AttachCache,
    BlocksLoaded,
    BlocksSaved,
    CacheServiceReady,
    CreateCache,
    DetachCache,
    DiskLoaded,
    DiskWritten,
    ExtendDeadline,
    ForgetHostBlocks,
    HostBlocksFilled,
    LoadBlocks,
    LoadFromDisk,
    PullDone,
    PullFrom,
    ReceiverStats,
    RemoveFromDisk,
    SaveBlocks,
    ServiceError,
    ServiceMessage,
    ServiceShutdown,
    SwapDone,
    SwapIn,
    TransferDone,
    WriteToDisk,
)
from pdserve.engine.prefix_loads import LoadResult
from pdserve.kv.layout import KVLayout
from pdserve.utils.child_process import ChildDied, ChildProcess


class CacheServiceClient:
    LOAD_TIMEOUT = 60.0  # seconds a host-tier load may take before the engine gives the service up

    def __init__(self, config: EngineConfig, ctx: zmq.Context, address: str, messager_address: str) -> None:
        self.child = ChildProcess("cache service", "pdserve.disagg.cache_service",
                                  ["--config", config.encode(), "--messager-address", messager_address],
                                  ctx, address, ServiceMessage)
        self.proc = self.child.proc
        self.refused_connections = 0  # decode side: KV connections its receivers refused
        self._attached_to_worker = False  # mixed role: the worker owns the cache, the service attached to it
        self._transfer_reports: list[TransferDone | SwapDone] = []  # arrived while a load was awaited
        self._saved: list[BlocksSaved] = []
        self._disk_written: list[DiskWritten] = []
        self._loads: list[LoadResult] = []  # disk reads and pulls finished

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.child.sock]

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
        """Transfer and swap reports the service sent since the last call."""
        self._drain()
        out, self._transfer_reports = self._transfer_reports, []
        return out

    # ---- the host tier (what ServiceCopies, engine/block_copies.py, orders) ----

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None:
        self.child.send(SaveBlocks(save_id, device_blocks, host_blocks, list(disk_keys), list(hashes)))

    def host_blocks_filled(self, host_blocks: list[int], disk_keys: list[bytes], hashes: list[bytes]) -> None:
        self.child.send(HostBlocksFilled(host_blocks, list(disk_keys), list(hashes)))

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self.child.send(LoadBlocks(host_blocks, device_blocks))
        while not isinstance(self._route(self.child.receive(self.LOAD_TIMEOUT, "copy blocks from the host tier")),
                             BlocksLoaded):
            pass

    def blocks_saved(self) -> list[tuple[int, list[int]]]:
        """(save id, host blocks) of the saves completed since the last call."""
        self._drain()
        out, self._saved = self._saved, []
        return [(m.save_id, m.host_blocks) for m in out]

    def write_to_disk(self, keys: list[bytes], host_blocks: list[int]) -> None:
        self.child.send(WriteToDisk(list(keys), list(host_blocks)))

    def disk_written(self) -> tuple[list[bytes], list[bytes]]:
        """(keys written whole, keys not written) since the last call."""
        self._drain()
        out, self._disk_written = self._disk_written, []
        return [k for m in out for k in m.written], [k for m in out for k in m.failed]

    def start_load_from_disk(self, load_id: str, keys: list[bytes], host_blocks: list[int]) -> None:
        self.child.send(LoadFromDisk(keys, host_blocks, load_id))

    def remove_from_disk(self, keys: list[bytes]) -> None:
        self.child.send(RemoveFromDisk(keys))

    def start_pull(self, load_id: str, addr: str, hashes: list[bytes], host_blocks: list[int],
                   deadline: float) -> None:
        """Pull a run of blocks from the peer's block server at `addr` into these host blocks (PullDone)."""
        self.child.send(PullFrom(load_id, addr, hashes, host_blocks, deadline))

    def loads_done(self) -> list[LoadResult]:
        """The disk reads and pulls the service finished since the last call."""
        self._drain()
        out, self._loads = self._loads, []
        return out

    def forget_host_blocks(self) -> None:
        self.child.send(ForgetHostBlocks())

    def _drain(self) -> None:
        while (msg := self.child.receive_nowait()) is not None:
            self._route(msg)

    def _route(self, msg: object) -> object:
        if isinstance(msg, TransferDone | SwapDone):
            self._transfer_reports.append(msg)
        elif isinstance(msg, BlocksSaved):
            self._saved.append(msg)
        elif isinstance(msg, DiskWritten):
            self._disk_written.append(msg)
        elif isinstance(msg, DiskLoaded):
            self._loads.append(LoadResult(msg.load_id, msg.ok))
        elif isinstance(msg, PullDone):
            self._loads.append(LoadResult(msg.pull_id, [True] * msg.num_blocks, msg.nbytes, msg.seconds))
        elif isinstance(msg, ReceiverStats):
            self.refused_connections = msg.refused_connections
        return msg

    def alive(self) -> bool:
        return self.child.alive()

    def exit_code(self) -> int | None:
        return self.proc.returncode

    def shutdown(self, timeout: float = 10.0, ask: bool = True) -> None:
        self.child.shutdown(ServiceShutdown(), timeout, ask)
