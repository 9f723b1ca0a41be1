"""The PD data plane without a model: byte ranges of the cache layout, the ipc and tcp transports,
and the cache messager's layer-by-layer writes, checked byte for byte between two real shared-memory caches."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.config.engine import EngineConfig
from pdserve.disagg.cache_messager import CacheMessager
from pdserve.disagg.messages import TransferDone
from pdserve.instance.startup import CACHE_SERVICE, TRUTH_TABLE, WORKER, Step
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout, block_ranges, coalesce, layer_ranges
from pdserve.kv.transfer_plan import LayerDone, StepTransfers, TransferPlan
from pdserve.transport import (
    CacheBuffer,
    IpcEndpoint,
    TcpEndpoint,
    TransferError,
    choose_endpoint,
    host_id,
    open_writer,
    rdma_available,
    start_receiver,
)
from pdserve.transport.ipc import buffer_address

LAYOUT = KVLayout(num_blocks=12, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture
def caches() -> Iterator[tuple[KVCache, KVCache]]:
    """P's cache filled with distinct values, D's (fewer blocks) zeroed."""
    p = KVCache.create_shared(LAYOUT)
    d = KVCache.create_shared(LAYOUT.with_blocks(9))
    p.tensor.copy_(torch.arange(p.tensor.numel(), dtype=torch.float32).view_as(p.tensor))
    yield p, d
    p.close()
    d.close()


def _fields(layout: KVLayout) -> dict:
    return {f: getattr(layout, f) for f in layout.__struct_fields__}


def _buffer(cache: KVCache) -> CacheBuffer:
    return CacheBuffer(cache.shm.buf, buffer_address(cache.shm.buf))


def test_ranges_follow_the_block_major_layout() -> None:
    lb, bb = LAYOUT.layer_block_bytes, LAYOUT.block_bytes
    assert lb == 2 * 4 * 2 * 8 * 4 and bb == 3 * lb
    assert layer_ranges(LAYOUT, [5, 6], [0, 2], 1) == [(5 * bb + lb, lb, lb), (6 * bb + lb, 2 * bb + lb, lb)]
    # adjacent on both sides merge; a gap on either side splits
    assert block_ranges(LAYOUT, [3, 4, 5, 9], [7, 8, 1, 2]) == [(3 * bb, 7 * bb, 2 * bb), (5 * bb, bb, bb),
                                                               (9 * bb, 2 * bb, bb)]
    assert coalesce([(0, 0, 4), (4, 4, 4), (8, 16, 4)]) == [(0, 0, 8), (8, 16, 4)]


def test_same_geometry_ignores_the_block_count() -> None:
    assert LAYOUT.same_geometry(KVLayout(**{**_fields(LAYOUT), "num_blocks": 100}))
    assert not LAYOUT.same_geometry(KVLayout(**{**_fields(LAYOUT), "head_dim": 16}))


@pytest.mark.parametrize("protocol", ["ipc", "tcp"])
def test_transport_writes_ranges_into_the_peer_cache(caches: tuple[KVCache, KVCache], protocol: str) -> None:
    p, d = caches
    receiver = start_receiver(protocol, _buffer(d), d.shm_name, "127.0.0.1")
    writer = open_writer(receiver.endpoint, _buffer(p))
    try:
        ranges = block_ranges(LAYOUT, [2, 3, 7], [0, 1, 5]) + layer_ranges(LAYOUT, [10], [8], 2)
        assert writer.write(ranges) == 3 * LAYOUT.block_bytes + LAYOUT.layer_block_bytes
        writer.flush()
        for src, dst in ((2, 0), (3, 1), (7, 5)):
            assert torch.equal(d.tensor[dst], p.tensor[src])
        assert torch.equal(d.tensor[8, 2], p.tensor[10, 2])
        assert not d.tensor[8, :2].any() and not d.tensor[[2, 3, 4, 6, 7]].any()
        with pytest.raises(TransferError, match="outside"):  # never past the end of either cache
            writer.write([(0, 9 * LAYOUT.block_bytes, 8)]) if protocol == "ipc" else \
                writer.write([(12 * LAYOUT.block_bytes, 0, 8)])
    finally:
        writer.close()
        receiver.close()


@pytest.mark.e2e  # two processes with UCX, a few seconds
@pytest.mark.skipif(not rdma_available(), reason="NIXL is not installed (make venv installs it)")
@pytest.mark.parametrize("ucx_tls", [None, "tcp"], ids=["ucx-default", "ucx-tcp"])
def test_rdma_transport_writes_ranges_between_two_processes(ucx_tls: str | None) -> None:
    # In processes of their own: UCX can crash an interpreter's teardown (tests/nixl_roundtrip.py).
    env = {**os.environ, **({"UCX_TLS": ucx_tls} if ucx_tls else {})}
    out = subprocess.run([sys.executable, "-m", "tests.nixl_roundtrip"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-2000:]


def test_rdma_without_nixl_is_refused_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdserve.transport

    monkeypatch.setattr(pdserve.transport, "rdma_available", lambda: False)
    with pytest.raises(ValueError, match="pip install nixl-cu12"):
        EngineConfig(splitwise_role="decode", cache_transfer_protocol=("rdma",))
    EngineConfig(cache_transfer_protocol=("rdma",))  # a mixed instance moves no KV: nothing to refuse


def test_tcp_writer_reports_a_missing_receiver() -> None:
    buf = bytearray(64)
    with pytest.raises(TransferError, match="cannot connect"):
        open_writer(TcpEndpoint("127.0.0.1", 1), CacheBuffer(memoryview(buf), 0))


def test_endpoint_choice_follows_our_preference_and_reach() -> None:
    ipc_here = IpcEndpoint("seg", 1, host_id())
    ipc_elsewhere = IpcEndpoint("seg", 1, "other-host/boot")
    tcp = TcpEndpoint("10.0.0.2", 5000)  # not contacted
    assert choose_endpoint(["ipc", "tcp"], [tcp, ipc_here]) == ipc_here
    assert choose_endpoint(["tcp", "ipc"], [tcp, ipc_here]) == tcp
    assert choose_endpoint(["ipc", "tcp"], [ipc_elsewhere, tcp]) == tcp  # another host's memory is out of reach
    assert choose_endpoint(["ipc"], [tcp]) is None


def _messager(p: KVCache, reports: list[TransferDone]) -> CacheMessager:
    return CacheMessager(_buffer(p), LAYOUT, reports.append)


def test_messager_streams_layer_by_layer_and_reports_after_the_last(caches: tuple[KVCache, KVCache]) -> None:
    p, d = caches
    endpoint = IpcEndpoint(d.shm_name, d.shm.size, host_id())
    reports: list[TransferDone] = []
    messager = _messager(p, reports)
    deadline = time.time() + 60
    # chunk 1: blocks 0-1 were a prefix-cache hit on P (whole blocks), block 2 computed now
    messager.handle(StepTransfers(1, [TransferPlan("t", endpoint, [4, 5, 6], [0, 1, 2], 2, False, deadline)]))
    messager.handle(LayerDone(1, 0))
    assert torch.equal(d.tensor[0], p.tensor[4]) and torch.equal(d.tensor[1], p.tensor[5])
    assert torch.equal(d.tensor[2, 0], p.tensor[6, 0]) and not d.tensor[2, 1:].any()  # only layer 0 so far
    for layer in (1, 2):
        messager.handle(LayerDone(1, layer))
    assert reports == []  # not the request's last chunk
    # chunk 2 (last): block 2 again (it was partial) and block 3
    messager.handle(StepTransfers(2, [TransferPlan("t", endpoint, [6, 8], [2, 3], 0, True, deadline)]))
    for layer in range(3):
        messager.handle(LayerDone(2, layer))
    assert torch.equal(d.tensor[:4], p.tensor[[4, 5, 6, 8]])
    (report,) = reports
    assert report.ok and report.transfer_id == "t"
    assert report.nbytes == 2 * LAYOUT.block_bytes + 3 * LAYOUT.layer_block_bytes + 2 * 3 * LAYOUT.layer_block_bytes
    assert report.first_write <= report.last_write
    messager.close()


def test_messager_fails_a_transfer_past_its_lease(caches: tuple[KVCache, KVCache]) -> None:
    p, d = caches
    endpoint = IpcEndpoint(d.shm_name, d.shm.size, host_id())
    reports: list[TransferDone] = []
    messager = _messager(p, reports)
    messager.handle(StepTransfers(1, [TransferPlan("late", endpoint, [1], [1], 0, True, time.time() - 1)]))
    for layer in range(3):
        messager.handle(LayerDone(1, layer))
    (report,) = reports  # reported once, not again at its last layer
    assert not report.ok and "lease" in report.error
    assert not d.tensor.any()  # nothing written after the lease
    messager.close()


def test_messager_reports_a_dead_receiver(caches: tuple[KVCache, KVCache]) -> None:
    p, _ = caches
    reports: list[TransferDone] = []
    messager = _messager(p, reports)
    messager.handle(StepTransfers(1, [TransferPlan("t", TcpEndpoint("127.0.0.1", 1), [1], [1], 0, True,
                                                   time.time() + 60)]))
    for layer in range(3):
        messager.handle(LayerDone(1, layer))
    (report,) = reports
    assert not report.ok and "cannot connect" in report.error


def test_truth_table_follows_the_design_rules() -> None:
    """DESIGN section 2's rules, checked on every row: one process creates the cache, after it started;
    the other attaches after cache-ready; a cache in shared memory: mixed rows, the worker owns it,
    alone without prefix caching; PD rows, the cache service owns it and starts first exactly when there
    is no profile run. A cache in device memory (section 4b): the worker owns it in every role, and
    creates it only after the cache service made the host memory it maps."""
    assert len(TRUTH_TABLE) == 16
    for (profile, mixed, prefix, device), steps in TRUTH_TABLE.items():
        creates = [s for s in steps if s in (Step.WORKER_CREATES_CACHE, Step.SERVICE_CREATES_CACHE)]
        assert len(creates) == 1 and len(set(steps)) == len(steps)
        owner = WORKER if creates[0] is Step.WORKER_CREATES_CACHE else CACHE_SERVICE
        start = {WORKER: Step.START_WORKER, CACHE_SERVICE: Step.START_CACHE_SERVICE}
        assert steps.index(start[owner]) < steps.index(creates[0])
        assert (Step.START_CACHE_SERVICE in steps) == (not mixed or prefix)
        if device:
            assert owner == WORKER and Step.WORKER_ATTACHES not in steps and Step.SERVICE_ATTACHES not in steps
            if Step.START_CACHE_SERVICE in steps:
                host = steps.index(Step.SERVICE_CREATES_HOST_MEMORY)
                assert steps.index(Step.START_CACHE_SERVICE) < host < steps.index(creates[0])
            continue
        assert Step.SERVICE_CREATES_HOST_MEMORY not in steps
        attach = {WORKER: Step.WORKER_ATTACHES, CACHE_SERVICE: Step.SERVICE_ATTACHES}
        others = [p for p in (WORKER, CACHE_SERVICE) if p != owner and start[p] in steps]
        for other in others:
            assert steps.index(creates[0]) < steps.index(attach[other]) and steps.index(start[other]) < steps.index(
                attach[other])
        assert owner == (WORKER if mixed else CACHE_SERVICE)
        assert (steps[0] is Step.START_CACHE_SERVICE) == (not mixed and not profile)


def test_messager_writes_on_after_a_lease_renewal(caches: tuple[KVCache, KVCache]) -> None:
    """The plan's deadline passed while the messager lagged, but P renewed D's lease meanwhile."""
    p, d = caches
    endpoint = IpcEndpoint(d.shm_name, d.shm.size, host_id())
    reports: list[TransferDone] = []
    messager = _messager(p, reports)
    messager.handle(StepTransfers(1, [TransferPlan("t", endpoint, [3], [4], 0, True, time.time() - 1)]))
    messager.extend("t", time.time() + 60)
    for layer in range(3):
        messager.handle(LayerDone(1, layer))
    (report,) = reports
    assert report.ok and torch.equal(d.tensor[4], p.tensor[3])
    messager.close()


def test_tcp_receiver_takes_no_kv_from_a_writer_without_the_cluster_secret(caches: tuple[KVCache, KVCache]) -> None:
    """A connection that does not answer the challenge, or answers it with another secret, is dropped
    before a byte of KV is read: D's cache stays zero. The right secret writes."""
    import socket
    import struct
    from array import array

    from pdserve.transport.tcp import HEADER, MAGIC, TcpReceiver, TcpWriter

    p, d = caches
    receiver = TcpReceiver(_buffer(d), "127.0.0.1", secret=b"cluster-a")
    try:
        payload = b"\x7f" * 64
        with socket.create_connection(("127.0.0.1", receiver.endpoint.port)) as raw:  # a stranger's raw write
            raw.sendall(HEADER.pack(MAGIC, 0, 1, len(payload)) + array("Q", [0, len(payload)]).tobytes() + payload)
            raw.settimeout(15)
            raw.recv(16)  # the challenge
            try:
                assert raw.recv(1) == b""  # then the receiver hangs up (a reset, as our bytes lie unread)
            except ConnectionResetError:
                pass
        with pytest.raises(TransferError):
            writer = TcpWriter(receiver.endpoint, _buffer(p), secret=b"cluster-b")
            writer.write([(0, 0, 256)], ack=True)
        deadline = time.monotonic() + 10
        while receiver.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.refused == 2 and receiver.bytes_received == 0
        assert not d.tensor.any(), "a refused connection wrote into the cache"
        writer = TcpWriter(receiver.endpoint, _buffer(p), secret=b"cluster-a")
        writer.write([(0, 0, 256)], ack=True)
        writer.close()
        assert bytes(d.shm.buf[:256]) == bytes(p.shm.buf[:256]) and struct.unpack("<f", d.shm.buf[4:8])[0] == 1.0
    finally:
        receiver.close()


def test_control_messages_must_carry_the_cluster_secret() -> None:
    from pdserve.utils.cluster_auth import AuthError, ControlSeal

    ours, theirs = ControlSeal(b"cluster-a"), ControlSeal(b"cluster-b")
    sealed = ours.seal(b"cache info")
    assert ControlSeal(b"cluster-a").open(sealed) == b"cache info"
    with pytest.raises(AuthError, match="bad tag"):
        ours.open(theirs.seal(b"cache info"))  # another cluster (or a forger)
    with pytest.raises(AuthError, match="bad tag"):
        ours.open(sealed[:-1] + b"X")  # tampered
    with pytest.raises(AuthError, match="not a sealed"):
        ours.open(b"\x81\xa4type\xa9CacheInfo")  # unsealed msgpack
    receiver = ControlSeal(b"cluster-a")
    receiver.open(sealed)
    with pytest.raises(AuthError, match="replayed"):
        receiver.open(sealed)


def test_messager_unmaps_a_decode_cache_that_was_removed(caches: tuple[KVCache, KVCache]) -> None:
    """A dead D's segment, swept by its restart, must not stay mapped (its memory would stay in use)."""
    p, _ = caches
    d = KVCache.create_shared(LAYOUT.with_blocks(4))
    endpoint = IpcEndpoint(d.shm_name, d.shm.size, host_id())
    reports: list[TransferDone] = []
    messager = _messager(p, reports)
    messager.handle(StepTransfers(1, [TransferPlan("t", endpoint, [1], [1], 0, True, time.time() + 60)]))
    for layer in range(3):
        messager.handle(LayerDone(1, layer))
    assert reports[0].ok
    name = d.shm_name
    mapped = lambda: name in Path("/proc/self/maps").read_text()  # noqa: E731
    messager.drop_gone_writers()
    d.close()  # the creator unmaps and removes the segment, as a sweep of a dead D's does
    assert mapped()  # the messager's writer still maps it: its memory is still in use
    messager.drop_gone_writers()
    assert not mapped()
    messager.close()
