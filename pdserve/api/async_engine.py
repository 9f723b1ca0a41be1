"""The asyncio face of an engine process: one pump task reading outputs, one queue per request."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.admission.load import LoadReport
from pdserve.engine.engine_client import EngineClient, EngineError
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    GetStats,
    PDParams,
    RequestOutput,
    Utility,
    UtilityCall,
    UtilityResult,
)
from pdserve.engine.prefix_pull import PullHint
from pdserve.engine.stats import EngineStats
from pdserve.sampling import SamplingParams


class AsyncEngine:
    """One engine; DataParallelEngine has the same face for N of them (`data_parallel`, `rank_clients`...)."""

    POLL_MS = 500
    data_parallel = False

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self._inputs = zmq.asyncio.Socket.from_socket(client.inputs)
        self._outputs = zmq.asyncio.Socket.from_socket(client.outputs)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineError]] = {}
        self._calls: dict[int, asyncio.Future[dict]] = {}
        self._call_ids = itertools.count(1 << 20)
        self._pump: asyncio.Task | None = None
        self.load: LoadReport | None = None  # the engine's latest load report
        self.error: str | None = None  # set once the engine is gone
        self.dead = asyncio.Event()  # ... and this with it

    @property
    def healthy(self) -> bool:
        return self.error is None and self.client.alive()

    @property
    def ready(self) -> EngineReady:
        return self.client.ready

    def close(self) -> None:
        self.client.close()

    def load_reports(self) -> list[LoadReport | None]:
        return [self.load]

    def rank_clients(self) -> list[tuple[int, EngineClient]]:
        return [(0, self.client)]

    def rank_counts(self) -> list[tuple[int, int, int]]:
        """(rank, requests sent to it, restarts) of each data-parallel rank: none here."""
        return []

    def start(self) -> None:
        self._pump = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except (asyncio.CancelledError, Exception):
                pass

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_ids: list[int], pd: PDParams | None = None, num_resumed: int = 0,
                       priority: int = 0, lora_name: str | None = None,
                       kv_pull: PullHint | None = None, trace_steps: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving early (client gone, stop string) aborts it in the engine."""
        if not self.healthy:
            raise EngineError(self.error or "the engine process is not running")
        queue: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._send(AddRequest(request_id, prompt_token_ids, params, eos_token_ids, time.time(), pd,
                                        num_resumed, priority, lora_name, kv_pull, trace_steps))
            while True:
                item = await queue.get()
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.healthy:
                await self._send(AbortRequests([request_id]))

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.healthy:
            await self._send(AbortRequests(request_ids))

    async def call(self, utility: Utility, timeout: float = 10.0) -> Any:
        if not self.healthy:
            raise EngineError(self.error or "the engine process is not running")
        call_id = next(self._call_ids)
        future: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(UtilityCall(call_id, utility))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def stats_by_rank(self) -> list[tuple[int, EngineStats | None]]:
        """The engine's `stats`, as the one data-parallel rank (None when it cannot answer)."""
        try:
            return [(0, await self.call(GetStats()))]
        except (EngineError, TimeoutError):
            return [(0, None)]

    async def _send(self, msg: object) -> None:
        try:
            await self._inputs.send(self._encoder.encode(msg))
        except zmq.Again:
            raise EngineError("the engine is not taking requests (send timed out)") from None

    async def _run(self) -> None:
        while True:
            if not await self._outputs.poll(self.POLL_MS):
                if not self.client.alive():
                    self._fail_all(f"the engine process exited (code {self.client.proc.returncode})")
                    return
                continue
            msg = self._decoder.decode(await self._outputs.recv())
            if isinstance(msg, EngineOutputs):
                if msg.load is not None:
                    self.load = msg.load
                for out in msg.outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
            elif isinstance(msg, UtilityResult):
                future = self._calls.get(msg.call_id)
                if future is not None and not future.done():
                    if msg.error is not None:
                        future.set_exception(EngineError(msg.error))
                    else:
                        future.set_result(msg.stats if msg.stats is not None else msg.result or {})
            elif isinstance(msg, EngineDead):
                self._fail_all(f"the engine died: {msg.error}")
                return

    def _fail_all(self, error: str) -> None:
        self.error = error
        self.dead.set()
        for queue in self._queues.values():
            queue.put_nowait(EngineError(error))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineError(error))
