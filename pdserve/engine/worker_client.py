"""The engine's handle on its worker process: start it, wait for it, send steps, notice its death."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import zmq

from pdserve.config import EngineConfig
from pdserve.engine.messages import (
    ExecuteStep,
    StepResult,
    WeightsCommand,
    WorkerError,
    WorkerMessage,
    WorkerReady,
    WorkerShutdown,
)
from pdserve.utils.process import child_env, stop_process


class WorkerDied(RuntimeError):
    pass


class WorkerClient:
    POLL_MS = 200

    def __init__(self, config: EngineConfig, ctx: zmq.Context, address: str) -> None:
        self.config = config
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.worker", "--config", config.encode(),
                                      "--address", address], env=child_env())
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerMessage)

    def wait_ready(self, timeout: float) -> WorkerReady:
        msg = self._receive(timeout, what="start (load weights, profile run, create the KV cache)")
        if isinstance(msg, WorkerError):
            raise WorkerDied(msg.error)
        assert isinstance(msg, WorkerReady)
        return msg

    def execute(self, step: ExecuteStep) -> StepResult:
        self.sock.send(self._encoder.encode(step))
        msg = self._receive(None, what="finish a step")
        if isinstance(msg, WorkerError):
            raise RuntimeError(msg.error)
        assert isinstance(msg, StepResult)
        return msg

    def weights(self, action: str) -> None:
        self.sock.send(self._encoder.encode(WeightsCommand(action)))
        msg = self._receive(None, what=f"{action} its weights")
        if isinstance(msg, WorkerError):
            raise RuntimeError(msg.error)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, lambda: self.sock.send(self._encoder.encode(WorkerShutdown()), flags=zmq.NOBLOCK),
                     timeout)
        self.sock.close()

    def _receive(self, timeout: float | None, what: str) -> WorkerMessage:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.sock.poll(self.POLL_MS):
            if not self.alive():
                raise WorkerDied(f"the worker process exited (code {self.proc.returncode}) before it could {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDied(f"the worker did not {what} within {timeout:.0f} s")
        return self._decoder.decode(self.sock.recv())
