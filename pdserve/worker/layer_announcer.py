"""Prefill role with the cache in device memory: tells the cache messager a layer is ready only once
its device -> staging copy has completed (an event, never just an enqueue).

One thread owns the PUSH socket to the messager (zmq sockets are not thread-safe) and sends in the order
messages were queued, each after its copies' events; the compute thread queues and goes on with the
next layer, so the copies overlap the forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from pdserve.worker.kv_copier import CopyEvent

log = logging.getLogger("pdserve.worker")
_STOP = object()


class LayerAnnouncer:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._ctx, self._address = ctx, address
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: str | None = None  # a send failed (the messager is gone); the next step reports it
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layer-announcer", daemon=True)
        self._thread.start()
        self._ready.wait()

    def send(self, payload: bytes, after: list[CopyEvent] = ()) -> None:
        self._queue.put((payload, list(after)))

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)  # a dead messager fails the step, not hangs it
        sock.connect(self._address)
        self._ready.set()
        try:
            while (item := self._queue.get()) is not _STOP:
                payload, events = item
                for event in events:
                    event.synchronize()
                try:
                    sock.send(payload)
                except zmq.ZMQError as e:
                    self.error = f"the cache messager did not take a layer signal: {e}"
                    log.error("%s", self.error)
        finally:
            sock.close()
