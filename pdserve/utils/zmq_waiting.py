"""The messages waiting on a ZMQ socket now, without blocking."""

from __future__ import annotations

from collections.abc import Iterator

import zmq


def waiting(sock: zmq.Socket) -> Iterator[bytes]:
    while True:
        try:
            yield sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
