"""The engine's handle on its worker process: start it, set up its cache, send steps, notice its death."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from pdserve.config.engine import EngineConfig
from pdserve.engine.messages import (
    CacheCommand,
    ExecuteStep,
    StepResult,
    WeightsCommand,
    WorkerError,
    WorkerLoaded,
    WorkerMessage,
    WorkerOk,
    WorkerReady,
    WorkerShutdown,
)
from pdserve.utils.child_process import ChildDied, ChildProcess

WorkerDied = ChildDied


class WorkerClient:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, address: str) -> None:
        self.config = config
        self.child = ChildProcess("worker", "pdserve.worker", ["--config", config.encode()], ctx, address,
                                  WorkerMessage)
        self.proc = self.child.proc

    def wait_loaded(self, timeout: float) -> WorkerLoaded:
        msg = self.child.receive(timeout, what="load the model and run the profile run")
        if isinstance(msg, WorkerError):
            raise WorkerDied(msg.error)
        assert isinstance(msg, WorkerLoaded)
        return msg

    def setup_cache(self, command: CacheCommand, timeout: float) -> WorkerReady:
        self.child.send(command)
        what = "create the KV cache" if command.create else "attach to the KV cache"
        msg = self.child.receive(timeout, what=what)
        if isinstance(msg, WorkerError):
            raise WorkerDied(msg.error)
        assert isinstance(msg, WorkerReady)
        return msg

    def execute(self, step: ExecuteStep, while_waiting: Callable[[], None] | None = None) -> StepResult:
        """Run one step; `while_waiting` runs every 50 ms of it (a step can outlast a PD lease)."""
        self.child.send(step)
        msg = self.child.receive(None, what="finish a step", while_waiting=while_waiting, poll_ms=50)
        if isinstance(msg, WorkerError):
            raise RuntimeError(msg.error)
        assert isinstance(msg, StepResult)
        return msg

    def weights(self, action: str) -> WorkerOk:
        self.child.send(WeightsCommand(action))
        msg = self.child.receive(None, what=f"{action} its weights")
        if isinstance(msg, WorkerError):
            raise RuntimeError(msg.error)
        assert isinstance(msg, WorkerOk)
        return msg

    def alive(self) -> bool:
        return self.child.alive()

    def shutdown(self, timeout: float = 10.0, ask: bool = True) -> None:
        self.child.shutdown(WorkerShutdown(), timeout, ask)
