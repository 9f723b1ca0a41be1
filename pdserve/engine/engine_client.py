"""The frontend's handle on an engine process (used by `LLM` and the API server)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pdserve.config.engine import EngineConfig
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    RequestOutput,
    Shutdown,
    Utility,
    UtilityCall,
    UtilityResult,
)
from pdserve.sampling import SamplingParams
from pdserve.utils.process import child_env, stop_process
from pdserve.utils.stale_ipc import make_ipc_folder, sweep_stale

# The engine process's entry (named, not imported: the instance package composes the engine and sits above it)
ENGINE_MODULE = "pdserve.instance.engine_process"


class EngineError(RuntimeError):
    """The engine could not start, died, or failed a request; err_type is the OpenAI error body's type."""

    def __init__(self, message: str, err_type: str = "internal_server_error") -> None:
        super().__init__(message)
        self.err_type = err_type


class EngineClient:
    POLL_MS = 200

    def __init__(self, config: EngineConfig, model_name: str = "", cpus: list[int] | None = None,
                 env: dict[str, str] | None = None, wait: bool = True) -> None:
        """`cpus`: the cores the engine and its workers may use (a data-parallel rank's share; None: ours);
        `env`: more environment for it (a data-parallel rank's CUDA_VISIBLE_DEVICES); `wait=False`: return once
        the process is started, `wait_ready()` later (the thread that starts it must outlive it: the engine's
        parent-death signal follows the starting thread, not the process)."""
        sweep_stale()
        try:
            self._dir = make_ipc_folder(os.getpid())
        except OSError as e:
            raise EngineError(str(e)) from e
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PUSH)
        self.inputs.setsockopt(zmq.LINGER, 0)
        self.inputs.setsockopt(zmq.SNDTIMEO, 10_000)
        self.inputs.bind(f"ipc://{Path(self._dir) / 'input'}")
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(f"ipc://{Path(self._dir) / 'output'}")
        self.proc = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE, "--config", config.encode(),
                                      "--input", f"ipc://{Path(self._dir) / 'input'}",
                                      "--output", f"ipc://{Path(self._dir) / 'output'}",
                                      "--model-name", model_name, "--sockdir", str(Path(self._dir) / "engine")],
                                     env={**child_env(), **(env or {})},
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._call_ids = itertools.count()
        self._buffered: list[RequestOutput] = []
        self._closed = False
        self._startup_timeout = config.startup_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the engine says it is ready (EngineReady, kept as `ready`); its failure raises EngineError."""
        try:
            msg = self._receive(self._startup_timeout, "start")
            if isinstance(msg, EngineDead):
                raise EngineError(msg.error)
            if not isinstance(msg, EngineReady):
                raise EngineError(f"unexpected first message from the engine: {type(msg).__name__}")
        except BaseException:
            self.close(ask=False)  # a starting engine reads no Shutdown message yet: SIGTERM now
            raise
        self.ready: EngineReady = msg

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: list[int], arrival_time: float | None = None, lora_name: str | None = None
                    ) -> None:
        self._send(AddRequest(request_id, prompt_token_ids, params, eos_token_ids, arrival_time or time.time(),
                              lora_name=lora_name))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(request_ids))

    def get_outputs(self, timeout: float | None = None) -> list[RequestOutput]:
        """The next batch of outputs; [] if none came within `timeout` seconds (None: wait)."""
        if self._buffered:
            out, self._buffered = self._buffered, []
            return out
        try:
            msg = self._receive(timeout, "answer")
        except TimeoutError:
            return []
        if isinstance(msg, EngineOutputs):
            return msg.outputs
        if isinstance(msg, EngineDead):
            raise EngineError(f"the engine died: {msg.error}")
        return []

    def call(self, utility: Utility, timeout: float = 60.0) -> Any:
        """A utility call (GetStats, CheckIdle, ResetPrefixCache, LoadLoRA ...); outputs that arrive meanwhile
        are kept."""
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, utility))
        deadline = time.monotonic() + timeout
        while True:
            msg = self._receive(max(deadline - time.monotonic(), 0.0), f"answer {type(utility).__name__}")
            if isinstance(msg, UtilityResult) and msg.call_id == call_id:
                if msg.error is not None:
                    raise EngineError(msg.error)
                return msg.stats if msg.stats is not None else msg.result or {}
            if isinstance(msg, EngineOutputs):
                self._buffered.extend(msg.outputs)
            elif isinstance(msg, EngineDead):
                raise EngineError(f"the engine died: {msg.error}")

    # ---- lifecycle -----------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 15.0, ask: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        shutdown = (lambda: self.inputs.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)) if ask \
            else self.proc.terminate
        stop_process(self.proc, shutdown, timeout)
        self.inputs.close()
        self.outputs.close()
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, msg: object) -> None:
        if self._closed:
            raise EngineError("the engine is closed")
        if not self.alive():  # a PUSH socket with no peer would block forever
            raise EngineError(f"the engine process exited (code {self.proc.returncode})")
        try:
            self.inputs.send(self._encoder.encode(msg))
        except zmq.Again:
            raise EngineError("the engine is not taking requests (send timed out)") from None

    def _receive(self, timeout: float | None, what: str) -> EngineMessage:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.outputs.poll(self.POLL_MS if deadline is None else
                                    max(0, min(self.POLL_MS, int((deadline - time.monotonic()) * 1000)))):
            if not self.alive():
                # It may have written its last words just before exiting.
                if self.outputs.poll(0):
                    break
                raise EngineError(f"the engine process exited (code {self.proc.returncode}) before it could {what}")
            if deadline is not None and time.monotonic() >= deadline:
                if what == "answer":
                    raise TimeoutError
                raise EngineError(f"the engine did not {what} within {timeout:.0f} s")
        return self._decoder.decode(self.outputs.recv())
