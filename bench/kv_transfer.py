"""How fast KV blocks move from a prefill cache into a decode cache, per transport, in one run.

    .venv/bin/python bench/kv_transfer.py [--blocks 1 8 32 128] [--repeat 5]

P's cache lives in this process, D's cache (and its tcp receiver) in a child process, both named
shared-memory segments with the embedded model's layout (block-major, 64-token blocks, fp32). For each
size it prints, beside our transports, the same bytes moved by a plain in-process memcpy and by a raw
TCP loopback stream (`sendall` / `recv_into` into a pre-faulted buffer), and the ratios the goals are
stated in: ipc >= 70% of memcpy, tcp >= 80% of the raw stream, for 16 MiB and up.

Two write patterns: "layer-wise" is what a prefill does (after each layer, that layer of every block:
30 writes of N scattered 96 KiB regions); "whole" sends whole blocks (one range per run of adjacent blocks).

With NIXL installed, rdma columns too: on one host UCX picks cma (one kernel copy between the
processes); run with `UCX_TLS=tcp` for UCX's TCP path, as between hosts without RDMA NICs.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import socket
import statistics
import threading
import time
from functools import partial

import msgspec
import torch

from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout, block_ranges, layer_ranges
from pdserve.transport import (
    CacheBuffer,
    Endpoint,
    IpcEndpoint,
    TcpEndpoint,
    host_id,
    open_writer,
    rdma_available,
    start_receiver,
)
from pdserve.transport.ipc import buffer_address
from pdserve.transport.tcp import TcpReceiver
from pdserve.utils import shm_segment as kv_segment

LAYOUT = KVLayout(num_blocks=160, num_layers=30, block_size=64, num_kv_heads=3, head_dim=64, dtype="float32")


def _raw_server(sock: socket.socket, size: int) -> None:
    buf = bytearray(size)  # pre-faulted below, reused for every stream
    view = memoryview(buf)
    view[:] = b"\0" * size
    while True:
        conn, _ = sock.accept()
        with conn:
            while True:
                header = conn.recv(8)
                if not header:
                    break
                n = int.from_bytes(header, "little")
                got = 0
                while got < n:
                    got += conn.recv_into(view[got:n])
                conn.sendall(b"\1")


def decode_side(conn: mp.connection.Connection) -> None:
    torch.set_num_threads(1)
    cache = KVCache.create_shared(LAYOUT)
    cache.tensor.zero_()  # pre-fault, as a long-running decode instance's reused blocks are
    buf = CacheBuffer(cache.shm.buf, buffer_address(cache.shm.buf))
    receiver = TcpReceiver(buf, "127.0.0.1")
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(raw, LAYOUT.nbytes), daemon=True).start()
    rdma = start_receiver("rdma", buf, cache.shm_name, "127.0.0.1") if rdma_available() else None
    conn.send((cache.shm_name, receiver.endpoint.port, raw.getsockname()[1],
               msgspec.msgpack.encode(rdma.endpoint) if rdma else None))
    conn.recv()  # until told to stop
    receiver.close()
    if rdma is not None:
        from pdserve.transport import nixl

        rdma.close()
        nixl.release()
        cache.close()
        nixl.exit_now(0)
    cache.close()


def _best(fn, repeat: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child,), daemon=True)
    proc.start()
    segment, tcp_port, raw_port, rdma_endpoint = parent.recv()
    p = KVCache.create_shared(LAYOUT)
    p.tensor.copy_(torch.randn(p.tensor.shape))
    src = CacheBuffer(p.shm.buf, buffer_address(p.shm.buf))
    scratch = torch.empty(LAYOUT.nbytes, dtype=torch.uint8)
    scratch.zero_()
    # The spawned child shares this process's resource tracker; keep its registration of its segment.
    kv_segment._created_here.add(segment)
    ipc = open_writer(IpcEndpoint(segment, LAYOUT.nbytes, host_id()), src)
    tcp = open_writer(TcpEndpoint("127.0.0.1", tcp_port), src)
    rdma = open_writer(msgspec.msgpack.decode(rdma_endpoint, type=Endpoint), src) if rdma_endpoint else None
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def raw_stream(nbytes: int) -> None:
        raw.sendall(nbytes.to_bytes(8, "little"))
        raw.sendall(src.view[:nbytes])
        raw.recv(1)

    print(f"layout: {LAYOUT.num_layers} layers, {LAYOUT.block_size}-token blocks, {LAYOUT.block_bytes / 2**20:.2f} MiB "
          f"per block, {LAYOUT.layer_block_bytes // 1024} KiB per layer of a block; best of {args.repeat}")
    header = (f"{'blocks':>6} {'MiB':>7} | {'memcpy':>7} {'raw tcp':>7} | {'ipc lw':>7} {'ipc wh':>7} {'tcp lw':>7} "
              f"{'tcp wh':>7} {'rdma lw':>7} {'rdma wh':>7} | {'ipc/memcpy':>10} {'tcp/raw':>8} {'rdma/raw':>8}"
              "   (GB/s; lw = layer-wise, wh = whole blocks)")
    print(header)
    print("-" * len(header))
    for n in args.blocks:
        n = min(n, LAYOUT.num_blocks // 2)
        nbytes = n * LAYOUT.block_bytes
        src_blocks = list(range(n))
        dst_blocks = list(range(LAYOUT.num_blocks - 1, LAYOUT.num_blocks - 1 - n, -1))  # no adjacent runs match
        layerwise = [layer_ranges(LAYOUT, src_blocks, dst_blocks, layer) for layer in range(LAYOUT.num_layers)]
        whole = block_ranges(LAYOUT, src_blocks, list(range(LAYOUT.num_blocks - n, LAYOUT.num_blocks)))

        runs = {
            "memcpy": partial(ctypes.memmove, scratch.data_ptr(), src.address, nbytes),
            "raw": partial(raw_stream, nbytes),
            "ipc_lw": partial(send, ipc, layerwise),
            "ipc_wh": partial(send, ipc, [whole]),
            "tcp_lw": partial(send, tcp, layerwise),
            "tcp_wh": partial(send, tcp, [whole]),
        }
        if rdma is not None:
            runs |= {"rdma_lw": partial(send, rdma, layerwise), "rdma_wh": partial(send, rdma, [whole])}
        results = {k: _best(run, args.repeat) for k, run in runs.items()}
        gbps = {k: nbytes / v / 1e9 for k, v in results.items()}
        nan = float("nan")
        print(f"{n:>6} {nbytes / 2**20:>7.1f} | {gbps['memcpy']:>7.2f} {gbps['raw']:>7.2f} | {gbps['ipc_lw']:>7.2f} "
              f"{gbps['ipc_wh']:>7.2f} {gbps['tcp_lw']:>7.2f} {gbps['tcp_wh']:>7.2f} {gbps.get('rdma_lw', nan):>7.2f} "
              f"{gbps.get('rdma_wh', nan):>7.2f} | {gbps['ipc_lw'] / gbps['memcpy']:>9.0%} "
              f"{gbps['tcp_lw'] / gbps['raw']:>8.0%} {gbps.get('rdma_lw', nan) / gbps['raw']:>8.0%}")
    one = [layer_ranges(LAYOUT, [0], [LAYOUT.num_blocks - 1], layer) for layer in range(LAYOUT.num_layers)]
    for name, writer in (("ipc", ipc), ("tcp", tcp), *((("rdma", rdma),) if rdma else ())):
        lat = []
        for _ in range(50):
            t = time.perf_counter()
            send(writer, one)
            lat.append(time.perf_counter() - t)
        print(f"one block, layer-wise, {name}: median {statistics.median(lat) * 1e6:.0f} us "
              f"(30 writes + flush)")
    ipc.close()
    tcp.close()
    raw.close()
    parent.send("stop")
    proc.join(10)
    if rdma is not None:
        from pdserve.transport import nixl

        rdma.close()
        nixl.release()
        p.close()
        nixl.exit_now(0)
    p.close()


def send(writer, ranges_per_call) -> None:  # noqa: ANN001
    for ranges in ranges_per_call:
        writer.write(ranges)
    writer.flush()


if __name__ == "__main__":
    main()
