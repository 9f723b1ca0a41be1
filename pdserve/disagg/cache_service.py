"""The cache service process (one per rank): holds the cache messager.

`python -m pdserve.disagg.cache_service --config B64 --address ipc://... --messager-address ipc://...`

The engine first sends CreateCache (PD roles: this process owns the cache segment; with the cache in
device memory it is the staging area the worker copies through, and a mixed instance gets only its
host tier) or AttachCache (mixed role: the worker owns it). Then, by role:
- prefill: the cache messager takes StepTransfers / LayerDone from the worker on `--messager-address`
  and writes the KV into decode instances; it reports TransferDone to the engine;
- decode: receivers for the transports that need one run here (tcp), writing into this cache;
- mixed: only the host tier's copies, if any.
With --swap-space (any role) it also keeps the host prefix tier: a segment of the cache's block layout
that SaveBlocks copies cache blocks into and LoadBlocks copies back (engine/host_tier.py is the index); with
--kv-disk-path too, SaveBlocks (and WriteToDisk) queue the blocks they are given keys for to a writer thread
(kv/disk_writer.py; DiskWritten reports them) and LoadFromDisk reads files back into host blocks
(engine/disk_tier.py is the index, kv/disk_store.py the files). A stop finishes the queued writes first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pdserve.config.engine import EngineConfig
from pdserve.config.roles import Role
from pdserve.disagg.block_server import BlockServer, HostBlockIndex
from pdserve.disagg.cache_messager import CacheMessager
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
    ServiceInput,
    ServiceShutdown,
    SwapDone,
    SwapIn,
    WriteToDisk,
)
from pdserve.disagg.prefix_pulls import PrefixPulls
from pdserve.kv.disk_store import DiskFiles
from pdserve.kv.disk_writer import DiskWriter
from pdserve.kv.layout import block_ranges
from pdserve.kv.transfer_plan import MessagerInput
from pdserve.transport import CacheBuffer, KVReceiver, start_receiver
from pdserve.transport.ipc import buffer_address
from pdserve.utils.process import STOP_CHECK_MS, child_entry, raise_if_stopping, recv_until_stopped
from pdserve.utils.shm_segment import KVSegment

log = logging.getLogger("pdserve.cache_service")


class CacheService:
    def __init__(self, config: EngineConfig, command: CreateCache | AttachCache, ctx: zmq.Context,
                 messager_address: str, report: object) -> None:
        self.cache: KVSegment | None = None
        if isinstance(command, CreateCache):
            if command.cache_segment:
                self.cache = KVSegment.create(command.layout.nbytes)
        else:
            self.cache = KVSegment.attach(command.segment, command.layout.nbytes)
        self.created = isinstance(command, CreateCache)
        self.layout = command.layout
        # Decode role with --splitwise-cache-buffer-size: P writes into a host buffer of the cache's block
        # layout, not into the cache; SwapIn copies a request's blocks over once its KV is complete.
        self.buffer: KVSegment | None = None
        if isinstance(command, CreateCache) and command.buffer_blocks:
            self.buffer = KVSegment.create(command.layout.with_blocks(command.buffer_blocks).nbytes)
            log.info("splitwise cache buffer: %d blocks (%.2f GiB) receive the prefill instances' KV",
                     command.buffer_blocks, command.buffer_blocks * command.layout.block_bytes / 2**30)
        self.host: KVSegment | None = None
        if command.host_blocks:
            self.host = KVSegment.create(command.layout.with_blocks(command.host_blocks).nbytes)
            log.info("host prefix tier (--swap-space): %d blocks (%.2f GiB)",
                     command.host_blocks, command.host_blocks * command.layout.block_bytes / 2**30)
        self.disk = DiskFiles(Path(command.disk_folder), command.layout.block_bytes) if command.disk_folder else None
        self.disk_writer = DiskWriter(self.disk) if self.disk is not None else None
        if config.rdma_comm_port and "rdma" in config.cache_transfer_protocol:
            port = config.rdma_comm_port  # UCX reads it when the NIXL agent is made (a free port is checked then)
            os.environ["UCX_TCP_PORT_RANGE"] = f"{port}-{port}"
        destination = self.buffer if self.buffer is not None else self.cache
        self.receivers: list[KVReceiver] = []
        self.messager: CacheMessager | None = None
        self.inbox: zmq.Socket | None = None
        if destination is not None:
            buffer = CacheBuffer(destination.shm.buf, buffer_address(destination.shm.buf))
        # An instance that may switch role (--enable-role-switch) keeps both sides' parts from the start.
        if config.splitwise_role == Role.DECODE or config.enable_role_switch:
            self.receivers = [start_receiver(p, buffer, destination.name, config.pd_host,
                                             config.advertise_host or config.pd_host)
                              for p in config.cache_transfer_protocol]
        if config.splitwise_role == Role.PREFILL or config.enable_role_switch:
            self.messager = CacheMessager(buffer, command.layout, report,  # type: ignore[arg-type]
                                          ranks=config.tensor_parallel_size)
            self.inbox = ctx.socket(zmq.PULL)
            self.inbox.setsockopt(zmq.LINGER, 0)
            self.inbox.bind(messager_address)
        self.messager_address = messager_address if self.messager is not None else None
        self.host_index: HostBlockIndex | None = None
        self.block_server: BlockServer | None = None
        self.pulls: PrefixPulls | None = None
        self.host_receivers: list[KVReceiver] = []
        if config.enable_kv_pull and self.host is not None and command.fingerprint:
            self._serve_pulls(config, ctx, command.fingerprint)

    def _serve_pulls(self, config: EngineConfig, ctx: zmq.Context, fingerprint: str) -> None:
        """Peers pull from this host tier (the block server) and write what this instance pulls into it."""
        host = CacheBuffer(self.host.shm.buf, buffer_address(self.host.shm.buf))
        self.host_index = HostBlockIndex()
        self.block_server = BlockServer(ctx, config.pd_host, host, self.layout, fingerprint,
                                        list(config.cache_transfer_protocol), self.host_index)
        self.host_receivers = [start_receiver(p, host, self.host.name, config.pd_host,
                                              config.advertise_host or config.pd_host)
                               for p in config.cache_transfer_protocol]
        self.pulls = PrefixPulls(ctx, self.host_index, fingerprint, [r.endpoint for r in self.host_receivers])
        log.info("prefix pulls: serving host-tier blocks on port %d; receiving over %s", self.block_server.port,
                 ", ".join(config.cache_transfer_protocol))

    def ready_message(self) -> CacheServiceReady:
        name = self.cache.name if self.cache is not None else None
        return CacheServiceReady(name, self.created, [r.endpoint for r in self.receivers],
                                 self.messager_address, self.buffer.name if self.buffer is not None else None,
                                 self.host.name if self.host is not None else None,
                                 self.block_server.port if self.block_server is not None else None,
                                 [r.endpoint for r in self.host_receivers])

    def close(self) -> None:
        if self.disk_writer is not None and (left := self.disk_writer.close(DISK_FLUSH_S)):
            log.warning("disk KV tier: stopped with %d block writes unfinished after %.0f s", left, DISK_FLUSH_S)
        for receiver in self.receivers + self.host_receivers:
            receiver.close()
        for part in (self.block_server, self.pulls):
            if part is not None:
                part.close()
        if self.messager is not None:
            self.messager.close()
            self.messager.source = None  # type: ignore[assignment]
        if self.inbox is not None:
            self.inbox.close()
        if (nixl := sys.modules.get("pdserve.transport.nixl")) is not None:
            nixl.release()  # before the memory it registered is unmapped
        for segment in (self.buffer, self.host):
            if segment is not None:
                segment.close()
        if self.cache is not None:
            self.cache.close()

    def swap_in(self, msg: SwapIn) -> SwapDone:
        """Buffer blocks -> cache blocks."""
        assert self.buffer is not None, "SwapIn needs --splitwise-cache-buffer-size"
        start = time.perf_counter()
        nbytes = self._copy(self.buffer, self.cache, msg.buffer_blocks, msg.cache_blocks)
        return SwapDone(msg.transfer_id, nbytes, time.perf_counter() - start)

    def save(self, msg: SaveBlocks) -> BlocksSaved:
        assert self.host is not None, "SaveBlocks needs --swap-space"
        start = time.perf_counter()
        self._copy(self.cache, self.host, msg.cache_blocks, msg.host_blocks)
        self.host_filled(HostBlocksFilled(msg.host_blocks, msg.disk_keys, msg.hashes))
        return BlocksSaved(msg.save_id, msg.host_blocks, time.perf_counter() - start)

    def host_filled(self, msg: HostBlocksFilled) -> None:
        """Blocks just copied into the host tier: served to peers from now on, and written to disk if keyed."""
        if self.host_index is not None:
            for host_block, block_hash in zip(msg.host_blocks, msg.hashes, strict=False):
                self.host_index.put(host_block, block_hash)
        self.write_to_disk(WriteToDisk(msg.disk_keys, msg.host_blocks))

    def write_to_disk(self, msg: WriteToDisk) -> None:
        """Queue the host blocks with a key (b"": none) to the writer thread."""
        for key, host_block in zip(msg.keys, msg.host_blocks, strict=False):
            if key:
                assert self.disk_writer is not None, "disk keys need --kv-disk-path"
                self.disk_writer.put(key, self._host_block(host_block))

    def disk_written(self) -> DiskWritten | None:
        """The writes finished since the last call, if any."""
        if self.disk_writer is None or not (results := self.disk_writer.results()):
            return None
        return DiskWritten([k for k, ok in results if ok], [k for k, ok in results if not ok])

    def load_from_disk(self, msg: LoadFromDisk) -> DiskLoaded:
        assert self.disk is not None, "LoadFromDisk needs --kv-disk-path"
        start = time.perf_counter()
        ok = []
        for key, host_block in zip(msg.keys, msg.host_blocks, strict=True):
            try:
                ok.append(self.disk.read(key, self._host_block(host_block)))
            except OSError as e:
                log.warning("disk KV tier: could not read a block (%s): a miss", e)
                ok.append(False)
            if self.host_index is not None:
                self.host_index.put(host_block, key) if ok[-1] else self.host_index.drop(host_block)
        return DiskLoaded(ok, time.perf_counter() - start, msg.load_id)

    def remove_from_disk(self, msg: RemoveFromDisk) -> None:
        if self.disk is not None:
            for key in msg.keys:
                self.disk.remove(key)

    def refused(self) -> int:
        """What failed the cluster secret here: KV connections, and prefix pulls asked or answered."""
        parts = [*self.receivers, *self.host_receivers, self.block_server, self.pulls]
        return sum(p.refused for p in parts if p is not None)

    def pull(self, msg: PullFrom) -> PullDone | None:
        if self.pulls is None:
            return PullDone(msg.pull_id, 0, error="this instance was started without --enable-kv-pull")
        return self.pulls.start(msg)

    def forget_host_blocks(self) -> None:
        if self.host_index is not None:
            self.host_index.clear()
        if self.pulls is not None:
            self.pulls.forget()

    def _host_block(self, block: int) -> memoryview:
        ((start, _, size),) = block_ranges(self.layout, [block], [block])
        return self.host.shm.buf[start:start + size]

    def load(self, msg: LoadBlocks) -> BlocksLoaded:
        assert self.host is not None, "LoadBlocks needs --swap-space"
        start = time.perf_counter()
        self._copy(self.host, self.cache, msg.host_blocks, msg.cache_blocks)
        return BlocksLoaded(time.perf_counter() - start)

    def _copy(self, src: KVSegment, dst: KVSegment, src_blocks: list[int], dst_blocks: list[int]) -> int:
        """Whole blocks between two segments of the cache's block layout, runs of adjacent blocks as one copy."""
        sbuf, dbuf = src.shm.buf, dst.shm.buf
        nbytes = 0
        for s, d, n in block_ranges(self.layout, src_blocks, dst_blocks):
            dbuf[d:d + n] = sbuf[s:s + n]
            nbytes += n
        return nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--messager-address", required=True)
    args = child_entry("cache service", parser, argv)
    config = EngineConfig.decode(args.config)
    ctx = zmq.Context()
    engine = ctx.socket(zmq.PAIR)
    engine.setsockopt(zmq.LINGER, 1000)
    engine.connect(args.address)
    encoder = msgspec.msgpack.Encoder()
    service = None
    try:
        command = msgspec.msgpack.decode(recv_until_stopped(engine), type=ServiceInput)
        if isinstance(command, ServiceShutdown):
            return 0
        try:
            service = CacheService(config, command, ctx, args.messager_address,
                                   lambda msg: engine.send(encoder.encode(msg)))
        except (OSError, ValueError, RuntimeError) as e:
            engine.send(encoder.encode(ServiceError(f"the cache service could not set up the KV cache: {e}")))
            return 1
        engine.send(encoder.encode(service.ready_message()))
        _serve(engine, service)
        return 0
    finally:
        if service is not None:
            service.close()
        engine.close()
        ctx.term()


GONE_WRITER_CHECK_S = 1.0  # a restarted decode instance sweeps its old segment seconds before it needs the room
DISK_WRITES_POLL_MS = 20  # how soon finished disk writes are reported while some are queued
DISK_FLUSH_S = 10.0  # a stopping service finishes its queued disk writes for this long at most


def _serve(engine: zmq.Socket, service: CacheService) -> None:
    _ServiceLoop(engine, service).run()


class _ServiceLoop:
    """The cache service's loop: the engine's orders, the worker's signals, peers' pulls, and what it reports."""

    def __init__(self, engine: zmq.Socket, service: CacheService) -> None:
        self.engine, self.service = engine, service
        self.poller = zmq.Poller()
        for sock in (engine, service.inbox, service.block_server and service.block_server.socket):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)
        self.polled_peers: set[zmq.Socket] = set()
        self.inbox_decoder = msgspec.msgpack.Decoder(MessagerInput)
        self.reported_refusals = 0
        self.next_check = 0.0
        # orders answered with a message (None: nothing to answer)
        self.orders: dict[type, Callable[[Any], msgspec.Struct | None]] = {
            ExtendDeadline: self._extend, DetachCache: lambda _: service.cache.close(),
            AttachCache: self._attach, SwapIn: service.swap_in, SaveBlocks: service.save, LoadBlocks: service.load,
            LoadFromDisk: service.load_from_disk, PullFrom: service.pull,
            ForgetHostBlocks: lambda _: service.forget_host_blocks(), WriteToDisk: service.write_to_disk,
            HostBlocksFilled: service.host_filled, RemoveFromDisk: service.remove_from_disk}

    def run(self) -> None:
        service = self.service
        while True:
            raise_if_stopping()
            self._follow_pull_peers()
            writing = service.disk_writer is not None and service.disk_writer.busy
            events = dict(self.poller.poll(DISK_WRITES_POLL_MS if writing else STOP_CHECK_MS))
            self._report()
            if service.block_server is not None and service.block_server.socket in events:
                service.block_server.handle_waiting()
            if service.messager is not None and time.monotonic() >= self.next_check:
                service.messager.drop_gone_writers()
                self.next_check = time.monotonic() + GONE_WRITER_CHECK_S
            if service.inbox in events:
                self._drain_inbox()  # first: the worker's signals are what the decode instances wait on
            if self.engine in events:
                msg = msgspec.msgpack.decode(self.engine.recv(), type=ServiceInput)
                if isinstance(msg, ServiceShutdown):
                    return
                if (reply := self.orders[type(msg)](msg)) is not None:
                    self._send(reply)

    def _follow_pull_peers(self) -> None:
        """The peers this service asked for blocks: their answers wake it."""
        if self.service.pulls is None:
            return
        peers = set(self.service.pulls.sockets)
        for dealer in peers - self.polled_peers:
            self.poller.register(dealer, zmq.POLLIN)
        for dealer in self.polled_peers - peers:
            self.poller.unregister(dealer)
        self.polled_peers = peers

    def _report(self) -> None:
        """Finished disk writes and pulls, and a change in the receivers' refusals."""
        service = self.service
        if (written := service.disk_written()) is not None:
            self._send(written)
        if service.pulls is not None:
            for done in service.pulls.answers():
                self._send(done)
        if (refused := service.refused()) != self.reported_refusals:
            self._send(ReceiverStats(refused))
            self.reported_refusals = refused

    def _drain_inbox(self) -> None:
        while True:
            try:
                raw = self.service.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.service.messager.handle(self.inbox_decoder.decode(raw))

    def _extend(self, msg: ExtendDeadline) -> None:
        if self.service.messager is not None:
            self.service.messager.extend(msg.transfer_id, msg.deadline)

    def _attach(self, msg: AttachCache) -> None:
        self.service.cache = KVSegment.attach(msg.segment, msg.layout.nbytes)

    def _send(self, msg: msgspec.Struct) -> None:
        self.engine.send(msgspec.msgpack.encode(msg))


def _exit(code: int) -> None:
    if (nixl := sys.modules.get("pdserve.transport.nixl")) is not None:
        nixl.exit_now(code)  # UCX may crash the interpreter's own teardown
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
