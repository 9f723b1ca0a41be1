"""A child process of the engine (worker, cache service) on a ZMQ PAIR socket: start it, wait for its
messages with a timeout, notice its death, stop it. Every wait names the process that did not come up."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import msgspec
import zmq

from pdserve.utils.process import child_env, raise_if_stopping, stop_process


class ChildDied(RuntimeError):
    """A child exited, reported a failure, or did not answer in time. The message says which and why."""


class ChildProcess:
    POLL_MS = 200

    def __init__(self, name: str, module: str, args: list[str], ctx: zmq.Context, address: str,
                 message_type: object) -> None:
        self.name = name
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--address", address, *args], env=child_env())
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def send(self, msg: object, timeout: float | None = None) -> None:
        """Send once the child is connected (a PAIR socket without a peer would block forever)."""
        self.send_bytes(self._encoder.encode(msg), timeout)

    def send_bytes(self, payload: bytes, timeout: float | None = None) -> None:
        """`send` of an encoded message (one encoding for several children)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.sock.poll(self.POLL_MS, zmq.POLLOUT):
            raise_if_stopping()
            if not self.alive():
                raise ChildDied(f"the {self.name} process exited (code {self.proc.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                raise ChildDied(f"the {self.name} process did not connect within {timeout:.0f} s")
        self.sock.send(payload)

    def receive(self, timeout: float | None, what: str, while_waiting: Callable[[], None] | None = None,
                poll_ms: int | None = None) -> object:
        """The child's next message; `while_waiting` runs every `poll_ms` until it comes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.sock.poll(poll_ms or self.POLL_MS):
            if while_waiting is not None:
                while_waiting()
            raise_if_stopping()
            if not self.alive():
                raise ChildDied(f"the {self.name} process exited (code {self.proc.returncode}) before it could {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise ChildDied(f"the {self.name} process did not {what} within {timeout:.0f} s")
        return self._decoder.decode(self.sock.recv())

    def receive_nowait(self) -> object | None:
        try:
            return self._decoder.decode(self.sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, shutdown_message: object, timeout: float = 10.0, ask: bool = True) -> None:
        """ask=False: SIGTERM at once, for a child that may not read messages yet (still starting)."""
        request = (lambda: self.sock.send(self._encoder.encode(shutdown_message), flags=zmq.NOBLOCK)) if ask \
            else self.proc.terminate
        stop_process(self.proc, request, timeout)
        self.sock.close()
