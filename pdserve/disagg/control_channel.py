"""The PD control channel: sealed, typed messages between a decode engine and a prefill engine.

P binds one ROUTER socket (--pd-comm-port); D keeps one DEALER per prefill instance it talks to.
Every message is a msgspec struct of `ControlMessage`, msgpack-encoded and sealed with the cluster
secret (cluster_auth.ControlSeal): a forged, replayed or undecodable message is dropped, logged and
counted, never acted on. Sends never block: a peer that is gone is the lease's business.
"""

from __future__ import annotations

import logging
import os
import uuid

import msgspec
import zmq

from pdserve.disagg.messages import ControlMessage
from pdserve.utils.cluster_auth import AuthError, ControlSeal, cluster_secret
from pdserve.utils.zmq_waiting import waiting

log = logging.getLogger("pdserve.pd")


class _Codec:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)
        self._seal = ControlSeal(cluster_secret())
        self.refused = 0  # forged, replayed or undecodable messages

    def encode(self, msg: ControlMessage) -> bytes:
        return self._seal.seal(self._encoder.encode(msg))

    def decode(self, raw: bytes, source: str) -> ControlMessage | None:
        """The message, or None (logged and counted) if it is not a genuine one from a cluster member."""
        try:
            return self._decoder.decode(self._seal.open(raw))
        except AuthError as e:
            log.warning("refused a control message from %s: %s", source, e)
        except msgspec.DecodeError:
            log.warning("dropped an undecodable control message from %s", source)
        self.refused += 1
        return None


class PrefillControl:
    """P's end: one ROUTER; a peer is known by the identity its messages came with."""

    def __init__(self, ctx: zmq.Context, host: str, port: int | None) -> None:
        self._codec = _Codec()
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")

    @property
    def refused(self) -> int:
        return self._codec.refused

    def receive(self) -> list[tuple[bytes, ControlMessage]]:
        """Every genuine message waiting now, with its sender's identity."""
        out = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 2:  # a peer's DEALER sends one frame; anything else is not ours
                self._codec.refused += 1
                log.warning("refused a control message of %d frames", len(frames))
                continue
            identity, raw = frames
            if (msg := self._codec.decode(raw, f"peer {identity[:40]!r}")) is not None:
                out.append((identity, msg))

    def send(self, identity: bytes, msg: ControlMessage) -> None:
        try:
            self.socket.send_multipart([identity, self._codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # D is gone; its lease frees its side

    def close(self) -> None:
        self.socket.close()


class DecodeControl:
    """D's end: a DEALER per prefill address, created on first use, with a fixed identity so that
    P's replies still find it after a reconnect."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._codec = _Codec()
        self._dealers: dict[str, zmq.Socket] = {}

    @property
    def refused(self) -> int:
        return self._codec.refused

    @property
    def sockets(self) -> list[zmq.Socket]:
        return list(self._dealers.values())

    def receive(self) -> list[tuple[str, ControlMessage]]:
        """Every genuine message waiting now, with the prefill address it came from."""
        out = []
        for addr, dealer in list(self._dealers.items()):
            for raw in waiting(dealer):
                if (msg := self._codec.decode(raw, addr)) is not None:
                    out.append((addr, msg))
        return out

    def send(self, prefill_addr: str, msg: ControlMessage) -> None:
        dealer = self._dealers.get(prefill_addr)
        if dealer is None:
            dealer = self._dealers[prefill_addr] = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 10_000)
            dealer.setsockopt(zmq.ROUTING_ID, f"d-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
            dealer.connect(f"tcp://{prefill_addr}")
        try:
            dealer.send(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # P unreachable: the lease ends this request

    def close(self) -> None:
        for dealer in self._dealers.values():
            dealer.close()
