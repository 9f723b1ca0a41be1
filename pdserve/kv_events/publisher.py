"""The engine's KV event publisher: each step's events as one numbered batch on a ZMQ PUB socket, and
a replay socket (vLLM's protocol: ROUTER; ask with the first sequence number wanted, get the batches
from it, then an end marker) that answers a subscriber which joined late or missed batches.

It runs inside the engine loop, not a thread: a batch is encoded and handed to ZMQ in microseconds, and
a snapshot then reads the prefix cache without a lock. When the batches asked for have left the replay
buffer, the answer is one snapshot batch (AllBlocksCleared, then every cached block) numbered as the last
batch sent, so the subscriber goes on from the next live one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import zmq

from pdserve.config.kv_events import KVEventsConfig
from pdserve.kv_events.events import END_OF_REPLAY, AllBlocksCleared, KVEvent, KVEventBatch, encoder


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, snapshot: Callable[[], list[KVEvent]], ctx: zmq.Context,
                 data_parallel_rank: int | None = None) -> None:
        self.snapshot, self.rank = snapshot, data_parallel_rank
        self.topic = config.topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self.pub.bind(config.endpoint)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if config.replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(config.replay_endpoint)
                self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self.close()
            raise RuntimeError(f"KV events: cannot bind {config.endpoint} / {config.replay_endpoint}: {e}") from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = -1
        self.publish([AllBlocksCleared()])  # whoever knew an earlier process at this address starts over

    @property
    def sockets(self) -> list[zmq.Socket]:
        """What the engine loop polls for this publisher (replay requests)."""
        return [self.replay] if self.replay is not None else []

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        payload = self._encode(events)
        self.pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))  # drops past the HWM
        self._buffer.append((self.seq, payload))

    def serve_replays(self) -> None:
        while self.replay is not None and self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._replay_from(start):
                self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _replay_from(self, start: int) -> list[tuple[int, bytes]]:
        if start > self.seq:
            return []
        if self._buffer and self._buffer[0][0] <= start:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start]
        return [(self.seq, self._encode([AllBlocksCleared(), *self.snapshot()]))]

    def _encode(self, events: list[KVEvent]) -> bytes:
        return encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank))

    def close(self) -> None:
        self.pub.close()
        if self.replay is not None:
            self.replay.close()
