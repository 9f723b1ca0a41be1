"""Any-host transport: KV bytes over a plain TCP stream, scattered straight into D's cache memory.

Wire format, per write: a header `PDKV flags n_ranges total_bytes`, n_ranges (offset, nbytes) pairs
of D's cache, then the payload in range order. The sender gathers P's regions with `sendmsg`
(writev) and the receiver scatters them into D's cache with `recvmsg_into` (readv), so no bytes are
copied in Python and no per-block call is made beyond building the buffer list. A write with the
ACK flag is answered with one byte once its payload is in D's memory; `flush` uses that.
Before any of that, the receiver challenges each new connection (cluster_auth): a writer without
the cluster secret is disconnected before a byte of KV is read.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from array import array
from collections.abc import Sequence

from pdserve.transport.base import ByteRange, CacheBuffer, KVReceiver, KVWriter, TcpEndpoint, TransferError
from pdserve.utils.cluster_auth import AuthError, answer_challenge, challenge_peer, cluster_secret

log = logging.getLogger("pdserve.transport.tcp")

HEADER = struct.Struct("<4sIIQ")
MAGIC = b"PDKV"
FLAG_ACK = 1
IOV_MAX = 1024  # Linux's limit on buffers per sendmsg/recvmsg call
SOCKET_BUFFER = 4 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """sendmsg every byte of `views`, IOV_MAX buffers at a time, resuming after partial sends."""
    i = 0
    while i < len(views):
        batch = views[i:i + IOV_MAX]
        sent = sock.sendmsg(batch)
        for v in batch:
            if sent >= v.nbytes:
                sent -= v.nbytes
                i += 1
            else:
                views[i] = v[sent:]
                break


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every byte of `views` from the stream, IOV_MAX buffers at a time."""
    i = 0
    while i < len(views):
        batch = views[i:i + IOV_MAX]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ConnectionError("the peer closed the connection mid-transfer")
        for v in batch:
            if got >= v.nbytes:
                got -= v.nbytes
                i += 1
            else:
                views[i] = v[got:]
                break


class TcpWriter(KVWriter):
    def __init__(self, endpoint: TcpEndpoint, source: CacheBuffer, timeout: float = 30.0,
                 secret: bytes | None = None) -> None:
        self._src = source
        self._pending_ack = False
        try:
            self._sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
            answer_challenge(self._sock, cluster_secret() if secret is None else secret)
        except (OSError, ConnectionError) as e:
            raise TransferError(f"cannot connect to the decode instance's KV receiver at "
                                f"{endpoint.host}:{endpoint.port}: {e}") from None
        _tune(self._sock)

    def write(self, ranges: Sequence[ByteRange], ack: bool = False) -> int:
        offsets = array("Q")
        views = []
        total = 0
        for src, dst, n in ranges:
            self._src.check(src, n, "source")
            if n == 0:
                continue
            offsets.extend((dst, n))
            views.append(self._src.view[src:src + n])
            total += n
        header = HEADER.pack(MAGIC, FLAG_ACK if ack else 0, len(views), total)
        try:
            send_views(self._sock, [memoryview(header), memoryview(offsets).cast("B"), *views])
            if ack:
                self._wait_ack()
        except OSError as e:
            raise TransferError(f"sending KV to the decode instance failed: {e}") from None
        return total

    def flush(self) -> None:
        self.write([], ack=True)

    def _wait_ack(self) -> None:
        if self._sock.recv(1) != b"\x01":
            raise TransferError("the decode instance's KV receiver closed the connection before acknowledging")

    def close(self) -> None:
        self._sock.close()


class TcpReceiver(KVReceiver):
    """Accepts P connections (one thread each) and writes what they send into this cache."""

    def __init__(self, destination: CacheBuffer, host: str, port: int = 0, advertise_host: str | None = None,
                 secret: bytes | None = None) -> None:
        self._dst = destination
        self._secret = cluster_secret() if secret is None else secret
        self.refused = 0  # connections that failed the challenge
        self._listener = socket.create_server((host, port), backlog=64)
        self._endpoint = TcpEndpoint(advertise_host or host, self._listener.getsockname()[1])
        self._closed = False
        self.bytes_received = 0
        threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()

    @property
    def endpoint(self) -> TcpEndpoint:
        return self._endpoint

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            _tune(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-tcp-recv", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        header = bytearray(HEADER.size)
        try:
            with conn:
                try:
                    challenge_peer(conn, self._secret)
                except AuthError as e:
                    self.refused += 1
                    log.warning("refused a KV connection from %s: %s", peer, e)
                    return
                while True:
                    try:
                        recv_views(conn, [memoryview(header)])
                    except ConnectionError:
                        return  # the writer closed between writes: the normal end
                    magic, flags, n_ranges, total = HEADER.unpack(header)
                    if magic != MAGIC:
                        raise TransferError(f"not a KV stream (magic {magic!r})")
                    offsets = array("Q", bytes(16 * n_ranges))
                    if n_ranges:
                        recv_views(conn, [memoryview(offsets).cast("B")])
                    views = []
                    for k in range(n_ranges):
                        offset, n = offsets[2 * k], offsets[2 * k + 1]
                        self._dst.check(offset, n, "destination")
                        if n:
                            views.append(self._dst.view[offset:offset + n])
                    if sum(v.nbytes for v in views) != total:
                        raise TransferError("KV stream header does not add up")
                    recv_views(conn, views)
                    self.bytes_received += total
                    if flags & FLAG_ACK:
                        conn.sendall(b"\x01")
        except (OSError, TransferError) as e:
            if not self._closed:
                log.warning("KV stream from %s dropped: %s", peer, e)
