"""What the engine sends its frontend: request outputs and load reports, held while the next step is computed.

A step's outputs go out once the next step is on the worker, or at once when nothing is computed next: the
frontend's work on them (detokenizing, streaming to clients) then overlaps the worker's step instead of
standing between one step and the next (on a 2-core box it sat on the critical path of every decode token).
"""

from __future__ import annotations

import msgspec
import zmq

from pdserve.admission.load import LoadReport
from pdserve.engine.messages import EngineOutputs, RequestOutput


class Outbox:
    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.outputs: list[RequestOutput] = []
        self.load: LoadReport | None = None
        self._encoder = msgspec.msgpack.Encoder()

    def add(self, outputs: list[RequestOutput]) -> None:
        self.outputs.extend(outputs)

    def report(self, load: LoadReport | None) -> None:
        """The newest load report (None: none due), sent with the outputs."""
        if load is not None:
            self.load = load

    def send(self) -> None:
        """Everything held, in one message."""
        if self.outputs or self.load is not None:
            self.socket.send(self._encoder.encode(EngineOutputs(self.outputs, self.load)))
            self.outputs, self.load = [], None

    def answer(self, result: msgspec.Struct) -> None:
        """A utility call's result, after everything held (so the caller sees what happened before its call)."""
        self.send()
        self.socket.send(self._encoder.encode(result))
