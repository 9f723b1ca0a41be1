"""`--kv-events-config`: vLLM's JSON (`KVEventsConfig`), e.g.
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'.

An instance that registers with a router publishes on free ports of its --host unless this says
otherwise ("publisher": "null" turns events off); the registration names the endpoints.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.utils.json_flag import json_struct

KNOWN_KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
              "max_queue_size", "topic")


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True):
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # or "null": no events
    endpoint: str = "tcp://*:5557"  # "*" as the port: a free one
    replay_endpoint: str | None = None  # where a subscriber asks for batches it missed, or for a snapshot
    buffer_steps: int = 10_000  # batches kept for replay; older ones are answered with a snapshot
    hwm: int = 100_000  # ZMQ send high-water mark: batches a slow subscriber may lag before it misses some
    max_queue_size: int = 100_000  # vLLM's bound on batches waiting to be sent; pdserve sends each at once
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher {self.publisher!r} is not served; pdserve publishes with \"zmq\" (or "
                             "\"null\": none)")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a ZMQ address (tcp://host:port), got {value!r}")
        if self.buffer_steps < 1 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("buffer_steps and max_queue_size must be at least 1, hwm at least 0")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Data-parallel rank `rank`'s endpoints: fixed ports moved up by the rank (vLLM's rule)."""
        if rank == 0:
            return self
        return msgspec.structs.replace(self, endpoint=_offset(self.endpoint, rank),
                                       replay_endpoint=self.replay_endpoint and _offset(self.replay_endpoint, rank))


def on_free_ports(host: str) -> KVEventsConfig:
    """What an instance that registers with a router publishes when --kv-events-config is not given."""
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://{host}:*", replay_endpoint=f"tcp://{host}:*")


def _offset(endpoint: str, rank: int) -> str:
    base, _, port = endpoint.rpartition(":")
    return endpoint if not port.isdigit() else f"{base}:{int(port) + rank}"


def kv_events_config(value: str | dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
    """From the flag's JSON text or a dict; unknown keys are an error, not ignored."""
    return json_struct(value, "--kv-events-config", KVEventsConfig, KNOWN_KEYS)
