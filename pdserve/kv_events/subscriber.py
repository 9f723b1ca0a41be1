"""A router's subscription to every registered engine's KV events, applied to its index (index.py).

One thread, one SUB socket (and one replay DEALER) per engine. Joining, it asks the replay socket for
everything from sequence 0: the batches still buffered, or the publisher's snapshot; live batches that
arrive meanwhile wait and are applied after it, those the replay covered skipped. A gap in the sequence
numbers (the publisher dropped batches for a slow subscriber, or a reconnect) asks again from the first
missing one. A reconnection (a publisher restarted at the same address: its numbers start again at 0)
starts over the same way, from batch 0, with the engine's entries dropped. An engine without a replay
socket is applied as it comes; a gap then drops what was indexed for it, since the index can no longer be
trusted, and it starts over from the next batch.
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.kv_events.events import END_OF_REPLAY, decoder
from pdserve.kv_events.index import KVIndex

log = logging.getLogger("pdserve.router.kv_events")

REPLAY_TIMEOUT_S = 2.0  # an unanswered replay request is sent again after this
SWEEP_S = 1.0
# After a wake-up the thread waits this long before the next: batches from many engines are then read in one
# go. It delays the index by as much; on this box it took the thread from 17% to ~8% of a core at 1,000 batches/s
# from 100 engines (bench/kv_index_cpu.py).
COALESCE_S = 0.01
KINDS = ("monitor", "replay", "sub")  # a source's sockets, in the order a wake-up reads them


@dataclass
class _Source:
    key: str
    url: str
    sub: zmq.Socket
    replay: zmq.Socket | None
    monitor: zmq.Socket  # the SUB socket's connections: a second one is a reconnection
    connections: int = 0
    last_seq: int = -1
    syncing: bool = False
    asked_at: float = 0.0
    held: list[tuple[int, bytes]] = field(default_factory=list)  # live batches received while syncing


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    resyncs: int = 0  # replays asked after a gap or a reconnection
    snapshots: int = 0  # replays answered with a snapshot
    undecodable: int = 0


class KVEventSubscriber:
    def __init__(self, index: KVIndex, topic: str = "") -> None:
        self.index, self.topic = index, topic.encode()
        self.stats = SubscriberStats()
        self._ctx = zmq.Context()
        self._sources: dict[str, _Source] = {}
        self._changes: deque[tuple[str, list[tuple[str, str | None]]]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, url: str, endpoints: list[tuple[str, str | None]]) -> None:
        """Subscribe to `url`'s engines (endpoint, replay endpoint), dropping what was known of it; none: forget it."""
        self._changes.append((url, endpoints))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if not self._thread.is_alive():
            for source in self._sources.values():
                _close(source)
        self._ctx.destroy(linger=0)  # closes what a thread stuck past the join still holds

    # ---- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        """Waits on the sockets' file descriptors (epoll): a wake-up costs what the ready sockets cost, not a
        scan of every engine's (a zmq.Poller over 300 sockets took 63% of a core at 1,000 batches/s)."""
        selector = selectors.DefaultSelector()
        swept = time.monotonic()
        while not self._stop.is_set():
            try:
                if self._changes:
                    self._take_changes(selector)
                if not self._sources:
                    self._stop.wait(0.1)
                    continue
                for key, _ in selector.select(timeout=0.1):
                    self._drain(*key.data)
                self._stop.wait(COALESCE_S)  # let batches gather: a wake-up per batch costs more than the batch
                if time.monotonic() - swept > SWEEP_S:
                    swept = time.monotonic()
                    self._sweep()
            except Exception:  # the index must not go stale silently: say so and go on
                log.exception("KV event subscriber")

    def _sweep(self) -> None:
        """Now and then: replay requests nobody answered are sent again, and every socket is read, since a send
        on a ZMQ socket can consume the edge its file descriptor gave for a message already waiting."""
        for source in list(self._sources.values()):
            for kind in KINDS:
                self._drain(source, kind)
            if source.syncing and time.monotonic() - source.asked_at > REPLAY_TIMEOUT_S:
                self._ask_replay(source)  # the publisher restarted or the request was lost

    def _drain(self, source: _Source, kind: str) -> None:
        sock = getattr(source, kind)
        try:
            while sock is not None and not sock.closed:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                if kind == "sub":
                    if len(frames) == 3 and len(frames[1]) == 8:
                        self._on_live(source, int.from_bytes(frames[1], "big"), frames[2])
                elif kind == "replay":
                    self._on_replay(source, frames)
                elif parse_monitor_message(frames)["event"] == zmq.EVENT_CONNECTED:
                    source.connections += 1
                    if source.connections > 1:
                        self._start_over(source)
        except zmq.ZMQError as e:
            log.warning("KV events of %s: %s", source.url, e)

    def _take_changes(self, selector: selectors.BaseSelector) -> None:
        while self._changes:
            url, endpoints = self._changes.popleft()
            for key in [k for k, s in self._sources.items() if s.url == url]:
                source = self._sources.pop(key)
                for sock in _sockets(source):
                    selector.unregister(sock.getsockopt(zmq.FD))
                _close(source)
            keys = [f"{url}#{i}" for i in range(len(endpoints))]
            self.index.set_sources(url, keys)
            for key, (endpoint, replay) in zip(keys, endpoints, strict=True):
                self._sources[key] = source = self._open(key, url, endpoint, replay)
                for kind in KINDS:
                    if (sock := getattr(source, kind)) is not None:
                        selector.register(sock.getsockopt(zmq.FD), selectors.EVENT_READ, (source, kind))
                self._ask_replay(source)
                for kind in KINDS:  # what arrived before the registration gave no edge
                    self._drain(source, kind)

    def _open(self, key: str, url: str, endpoint: str, replay: str | None) -> _Source:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(endpoint)
        dealer = None
        if replay:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
        return _Source(key, url, sub, dealer, monitor)

    def _on_live(self, source: _Source, seq: int, payload: bytes) -> None:
        if source.syncing:
            source.held.append((seq, payload))
        elif seq == 0 and source.last_seq > 0:  # a new publisher at the same address: it starts over
            source.last_seq = -1
            self._apply(source, seq, payload)
        elif seq <= source.last_seq:
            return
        elif seq == source.last_seq + 1 or source.last_seq < 0 and source.replay is None:
            self._apply(source, seq, payload)
        elif source.replay is not None:  # batches were missed
            self.stats.resyncs += 1
            source.held.append((seq, payload))
            self._ask_replay(source)
        else:
            log.warning("KV events of %s: batches %d..%d missed and no replay socket: its index starts over",
                        source.url, source.last_seq + 1, seq - 1)
            self.index.clear(source.key)
            self._apply(source, seq, payload)

    def _on_replay(self, source: _Source, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        _, seq_bytes, payload = frames
        if seq_bytes != END_OF_REPLAY:
            seq = int.from_bytes(seq_bytes, "big")
            self.stats.snapshots += seq > source.last_seq + 1  # the batches asked for had left its buffer
            if seq > source.last_seq:
                self._apply(source, seq, payload)
            return
        source.syncing = False
        held, source.held = sorted(source.held), []
        for seq, payload in held:
            self._on_live(source, seq, payload)

    def _start_over(self, source: _Source) -> None:
        """Its publisher may be a new process: drop what is indexed and take everything from batch 0."""
        self.stats.resyncs += 1
        self.index.clear(source.key)
        source.last_seq, source.held = -1, []
        self._ask_replay(source)

    def _ask_replay(self, source: _Source) -> None:
        if source.replay is None:
            return
        source.syncing, source.asked_at = True, time.monotonic()
        source.replay.send_multipart((b"", (source.last_seq + 1).to_bytes(8, "big")))

    def _apply(self, source: _Source, seq: int, payload: bytes) -> None:
        try:
            batch = decoder.decode(payload)
        except msgspec.DecodeError:
            self.stats.undecodable += 1
            return
        source.last_seq = seq
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.index.apply(source.key, batch.events)


def _sockets(source: _Source) -> list[zmq.Socket]:
    return [sock for kind in KINDS if (sock := getattr(source, kind)) is not None]


def _close(source: _Source) -> None:
    source.sub.disable_monitor()
    source.monitor.close()
    source.sub.close()
    if source.replay is not None:
        source.replay.close()
