"""The engine's handle on its worker processes, one per tensor-parallel rank: start them, set up their
cache, send steps, notice a death.

Every rank gets every message (a step's bytes are encoded once) and answers it; rank 0's answer is the one
that counts (it samples), the others only confirm. A shared CPU cache is created by rank 0 and attached by
the others after it, each then viewing its heads; a cache in device memory is every rank's own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from pdserve.config.engine import EngineConfig
from pdserve.utils.child_process import ChildDied, ChildProcess
from pdserve.worker.protocol import (
    CacheCommand,
    CalibrateCommand,
    Calibration,
    ExecuteStep,
    LoRACommand,
    StepResult,
    WeightsCommand,
    WorkerError,
    WorkerLoaded,
    WorkerMessage,
    WorkerOk,
    WorkerReady,
    WorkerShutdown,
)

WorkerDied = ChildDied


class WorkerFailed(Exception):
    """The worker reported that it could not do what it was asked (a step, a LoRA adapter, loading weights);
    it is alive and takes the next command. Its death is WorkerDied."""


class WorkerClient:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, address: str) -> None:
        """`address` is rank 0's socket; rank r's is `address` + r (for r > 0)."""
        self.config = config
        n = config.tensor_parallel_size
        rendezvous = f"{address.removeprefix('ipc://')}.ranks"
        Path(rendezvous).unlink(missing_ok=True)  # gloo's file store must start empty
        self.ranks = [ChildProcess("worker" if r == 0 else f"worker rank {r}", "pdserve.worker",
                                   ["--config", config.encode(), "--rank", str(r), "--rendezvous", rendezvous],
                                   ctx, address if r == 0 else f"{address}{r}", WorkerMessage) for r in range(n)]
        self.child = self.ranks[0]
        self.num_blocks: int | None = None  # the smallest rank's block count, once loaded
        self.weights_resident: list[int] = []  # per rank, bytes its weights took (RSS growth while loading)
        self._encoder = msgspec.msgpack.Encoder()

    def wait_loaded(self, timeout: float) -> WorkerLoaded:
        """Every rank loaded its weights; the block count is the smallest rank's."""
        loaded = [self._expect(rank, WorkerLoaded, timeout, "load the model and run the profile run")
                  for rank in self.ranks]
        first = loaded[0]
        self.weights_resident = [m.weights_resident for m in loaded]
        self.num_blocks = min(m.layout.num_blocks for m in loaded)
        return msgspec.structs.replace(first, layout=first.layout.with_blocks(self.num_blocks))

    def setup_cache(self, command: CacheCommand, timeout: float) -> WorkerReady:
        """Rank 0 first: a shared segment it creates is the one the other ranks attach to."""
        what = "create the KV cache" if command.create else "attach to the KV cache"
        if command.num_blocks is None and self.num_blocks is not None:  # every rank: the smallest rank's count
            command = msgspec.structs.replace(command, num_blocks=self.num_blocks)
        self.child.send(command)
        ready = self._expect(self.child, WorkerReady, timeout, what)
        if not command.private and command.create:
            command = msgspec.structs.replace(command, create=False, segment=ready.kv_cache_name)
        for rank in self.ranks[1:]:
            rank.send(command)
        for rank in self.ranks[1:]:
            self._expect(rank, WorkerReady, timeout, what)
        return ready

    def execute(self, step: ExecuteStep, while_waiting: Callable[[], None] | None = None,
                sent: Callable[[], None] | None = None) -> StepResult:
        """Run one step on every rank; `sent` runs once every rank has it, `while_waiting` every 50 ms of it (a
        step can outlast a PD lease)."""
        payload = self._encoder.encode(step)
        for rank in self.ranks:
            rank.send_bytes(payload)
        if sent is not None:
            sent()

        def waiting() -> None:
            self._check_alive()
            if while_waiting is not None:
                while_waiting()

        results = [rank.receive(None, what="finish a step", while_waiting=waiting, poll_ms=50) for rank in self.ranks]
        for msg in results:
            if isinstance(msg, WorkerError):
                raise WorkerFailed(msg.error)
        assert isinstance(results[0], StepResult)
        return results[0]

    def weights(self, action: str) -> WorkerOk:
        """Free or load every rank's weights; on a load, rank 0 makes the shared cache again first."""
        self.child.send(WeightsCommand(action))
        ok = self._expect(self.child, WorkerOk, None, f"{action} its weights", WorkerFailed)
        for rank in self.ranks[1:]:
            rank.send(WeightsCommand(action, ok.kv_cache_name))
            self._expect(rank, WorkerOk, None, f"{action} its weights", WorkerFailed)
        return ok

    def calibrate(self, command: CalibrateCommand, timeout: float) -> Calibration:
        """Every rank times the same steps (they meet in the all-reduces); the first rank's times."""
        for rank in self.ranks:
            rank.send(command)
        times = [self._expect(rank, Calibration, timeout, "time the calibration steps", WorkerFailed)
                 for rank in self.ranks]
        return times[0]

    def lora(self, action: str, name: str, path: str = "") -> None:
        """Load or unload a LoRA adapter on every rank; WorkerFailed says why one could not."""
        for rank in self.ranks:
            rank.send(LoRACommand(action, name, path))
            self._expect(rank, WorkerOk, None, f"{action} LoRA adapter {name!r}", WorkerFailed)

    def alive(self) -> bool:
        return all(rank.alive() for rank in self.ranks)

    def _check_alive(self) -> None:
        """A rank that died leaves the others waiting (in the rendezvous, in an all-reduce): say which."""
        if not self.alive():
            raise WorkerDied(self.exit_message())

    def exit_message(self) -> str:
        """Which rank's process exited, and its code."""
        dead = [rank for rank in self.ranks if not rank.alive()]
        return "; ".join(f"the {rank.name} process exited (code {rank.proc.returncode})" for rank in dead)

    def shutdown(self, timeout: float = 10.0, ask: bool = True) -> None:
        for rank in self.ranks:
            rank.shutdown(WorkerShutdown(), timeout, ask)

    def _expect(self, rank: ChildProcess, kind: type, timeout: float | None, what: str,
                error: type[Exception] = WorkerDied) -> object:
        msg = rank.receive(timeout, what=what, while_waiting=self._check_alive)
        if isinstance(msg, WorkerError):
            raise error(msg.error if rank.name == "worker" else f"{rank.name}: {msg.error}")
        assert isinstance(msg, kind), f"{rank.name} answered {type(msg).__name__}, not {kind.__name__}"
        return msg
