"""What the engine needs from the PD machinery, and the no-op stand-ins of an instance without it.

A KV connector is the scheduler-side half of PD (vLLM's split): the engine calls its hooks at fixed
points of its loop and acts on nothing else of it; a connector acts on the engine only through the
scheduler's public methods (check_request, add_request, preallocate, mark_prefilled, abort,
free_blocks, release_blocks, has_waiting). pdserve.disagg implements it for the prefill and decode
roles (prefill_connector.py, decode_connector.py); the engine holds its role's (none for a mixed
instance, both for one that may change role) behind role_connectors.py. Nothing in
pdserve.engine imports pdserve.disagg: pdserve.instance (build.py), above both, wires
the two together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import zmq

    from pdserve.engine.messages import PDParams, RequestOutput
    from pdserve.engine.prefix_loads import LoadResult
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler_output import ScheduledChunk
    from pdserve.engine.stats import PDStats
    from pdserve.kv.layout import KVLayout
    from pdserve.kv.transfer_plan import TransferPlan
    from pdserve.worker.protocol import TokenLogprobs


class KVConnector(Protocol):
    port: int | None  # where peers reach this instance's control plane (a prefill instance's), else None

    @property
    def sockets(self) -> list[zmq.Socket]:
        """What the engine loop polls besides its input, to wake when a peer speaks."""

    def add_request(self, request: Request, pd: PDParams) -> list[RequestOutput]:
        """Take a PD request (the connector hands it to the scheduler when its phase allows)."""

    def transfers(self, chunks: list[ScheduledChunk]) -> list[TransferPlan]:
        """This step's KV writes, for the worker to pass to the cache messager."""

    def on_prefilled(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        """A KV-producing request finished its prefill with this first token."""

    def poll(self) -> list[RequestOutput]:
        """Messages from peers and the cache service, and expired leases. Finished outputs end their
        request here: the engine forgets it on the worker."""

    def abort(self, request_id: str) -> Request | None:
        """The frontend aborted it: the request if the connector ended it, None if the scheduler must."""

    @property
    def held(self) -> int:
        """Transfers it holds (blocks or peers waiting on them): none when the instance may change role."""

    def next_deadline(self) -> float | None:
        """The earliest moment poll() has something to do without a message (unix time)."""

    def during_step(self) -> None:
        """Called every few ms while the worker runs a step, whose length has no bound: keep what must
        not lapse meanwhile (P's lease renewals) alive. Nothing else of the engine's state may change."""

    def stats(self) -> PDStats | None:
        """Counters for /metrics (None: no PD role)."""

    def close(self) -> None: ...


class CacheService(Protocol):
    """The cache service process as the engine sees it (started per the startup table, or not)."""

    @property
    def sockets(self) -> list[zmq.Socket]:
        """What the engine loop polls to hear of completed host-tier saves."""

    def blocks_saved(self) -> list[tuple[int, list[int]]]:
        """Host-tier saves completed since the last call: (save id, host blocks)."""

    def alive(self) -> bool: ...

    def exit_code(self) -> int | None: ...

    def worker_cache_freed(self) -> None:
        """The worker freed its cache (POST /clear_load_weight): let go of it too if attached to it."""

    def worker_cache_created(self, layout: KVLayout, segment: str | None) -> None:
        """The worker made a new cache (weights loaded again): attach to it if this service did before."""

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None: ...

    def host_blocks_filled(self, host_blocks: list[int], disk_keys: list[bytes], hashes: list[bytes]) -> None:
        """The worker filled these host blocks (a device cache): index them for pulls, write the keyed ones."""

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None: ...

    def start_load_from_disk(self, load_id: str, keys: list[bytes], host_blocks: list[int]) -> None: ...

    def write_to_disk(self, keys: list[bytes], host_blocks: list[int]) -> None: ...

    def disk_written(self) -> tuple[list[bytes], list[bytes]]:
        """Disk writes finished since the last call: (keys written whole, keys not written)."""

    def remove_from_disk(self, keys: list[bytes]) -> None: ...

    def start_pull(self, load_id: str, addr: str, hashes: list[bytes], host_blocks: list[int],
                   deadline: float) -> None: ...

    def loads_done(self) -> list[LoadResult]:
        """Disk reads and pulls completed since the last call."""

    def forget_host_blocks(self) -> None: ...

    def swap_in(self, transfer_id: str, buffer_blocks: list[int], cache_blocks: list[int]) -> None: ...


class NoCacheService:
    """The rows of the startup table that start no cache service."""

    sockets: list = []

    def blocks_saved(self) -> list[tuple[int, list[int]]]:
        return []

    def disk_written(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def alive(self) -> bool:
        return True

    def exit_code(self) -> int | None:
        return None

    def worker_cache_freed(self) -> None:
        pass

    def worker_cache_created(self, layout: KVLayout, segment: str | None) -> None:
        pass

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None:
        raise RuntimeError("no cache service runs: there is no host tier to save to")

    def host_blocks_filled(self, host_blocks: list[int], disk_keys: list[bytes], hashes: list[bytes]) -> None:
        raise RuntimeError("no cache service runs: there is no host tier")

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        raise RuntimeError("no cache service runs: there is no host tier to load from")

    def load_from_disk(self, keys: list[bytes], host_blocks: list[int]) -> list[bool]:
        raise RuntimeError("no cache service runs: there is no disk tier")

    def write_to_disk(self, keys: list[bytes], host_blocks: list[int]) -> None:
        raise RuntimeError("no cache service runs: there is no disk tier")

    def remove_from_disk(self, keys: list[bytes]) -> None:
        raise RuntimeError("no cache service runs: there is no disk tier")

    def pull_blocks(self, addr: str, hashes: list[bytes], host_blocks: list[int], deadline: float,
                    wait_until: float) -> tuple[int, int] | None:
        raise RuntimeError("no cache service runs: there is no host tier to pull into")

    def forget_host_blocks(self) -> None:
        pass

    def swap_in(self, transfer_id: str, buffer_blocks: list[int], cache_blocks: list[int]) -> None:
        raise RuntimeError("no cache service runs: there is no decode buffer")
