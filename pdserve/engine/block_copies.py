"""Who copies KV blocks between the cache and its host memory (the host prefix tier, the decode buffer, the
staging area P writes into), behind one interface the engine and the connectors use alike.

- `ServiceCopies`: the cache is a shared-memory segment the cache service maps, so the service copies on
  the engine's orders (host-tier saves reported later, loads awaited, swap-ins reported with its transfer
  reports); nothing rides with the worker's steps, and what P writes lands in the cache itself.
- `WorkerCopies` (worker_copies.py): the cache is in device memory, which only the worker reaches; the
  copies ride with its next step and run before the forward pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import zmq

    from pdserve.engine.kv_connector import CacheService
    from pdserve.engine.prefix_loads import LoadResult
    from pdserve.worker.protocol import BlockCopy


class BlockCopies(Protocol):
    @property
    def sockets(self) -> list[zmq.Socket]:
        """What the engine polls to hear of completed host-tier saves."""

    @property
    def pending(self) -> bool:
        """Copies wait for a worker step: the engine sends one even when nothing is scheduled."""

    def take(self) -> list[BlockCopy]:
        """The copies that ride with the step about to be sent."""

    def done(self, copy_ids: list[int]) -> None:
        """The worker completed these copies."""

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None:
        """Start copying cache blocks to host-tier blocks, reported done later (blocks_saved); those with a disk
        key (b"": none) then go on to the disk tier (disk_written). `hashes` (--enable-kv-pull): each block's
        hash, so that the cache service serves it to peers."""

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host-tier blocks into cache blocks, complete before any later step reads them."""

    def blocks_saved(self) -> list[tuple[int, list[int]]]:
        """(save id, host blocks) of the saves completed since the last call."""

    def write_to_disk(self, keys: list[bytes], host_blocks: list[int]) -> None:
        """Write host-tier blocks to the disk tier under these keys (disk_written)."""

    def disk_written(self) -> tuple[list[bytes], list[bytes]]:
        """(keys written whole, keys not written) since the last call."""

    def start_load_from_disk(self, load_id: str, keys: list[bytes], host_blocks: list[int]) -> None:
        """Start reading disk-tier blocks into host-tier blocks; loads_done() reports, per key, whether it was whole
        and intact."""

    def remove_from_disk(self, keys: list[bytes]) -> None:
        """Delete these disk-tier blocks' files."""

    def start_pull(self, load_id: str, addr: str, hashes: list[bytes], host_blocks: list[int],
                   deadline: float) -> None:
        """Start pulling a run of blocks from a peer (--enable-kv-pull) into these host blocks, to be written by
        `deadline` (unix time); loads_done() reports the leading blocks written and the bytes."""

    def loads_done(self) -> list[LoadResult]:
        """The disk reads and pulls that completed since the last call."""

    def forget_host_blocks(self) -> None:
        """The host tier was cleared: serve none of its blocks to peers."""

    def swap_in(self, transfer_id: str, buffer_blocks: list[int], cache_blocks: list[int]) -> None:
        """Decode buffer -> cache; reported once copied."""

    def swaps_done(self) -> list[tuple[str, int, float]]:
        """(transfer id, bytes, seconds) of the swap-ins this copier reports itself."""

    def stage_in(self, blocks: list[int]) -> None:
        """What P wrote for these blocks is to be in the cache before the step that decodes them."""


class ServiceCopies:
    """The cache service copies (a cache in shared memory)."""

    pending = False

    def __init__(self, service: CacheService) -> None:
        self.service = service

    @property
    def sockets(self) -> list[zmq.Socket]:
        return self.service.sockets

    def take(self) -> list[BlockCopy]:
        return []

    def done(self, copy_ids: list[int]) -> None:
        pass

    def save_blocks(self, save_id: int, device_blocks: list[int], host_blocks: list[int],
                    disk_keys: list[bytes] = (), hashes: list[bytes] = ()) -> None:
        self.service.save_blocks(save_id, device_blocks, host_blocks, disk_keys, hashes)

    def load_blocks(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self.service.load_blocks(host_blocks, device_blocks)

    def blocks_saved(self) -> list[tuple[int, list[int]]]:
        return self.service.blocks_saved()

    def write_to_disk(self, keys: list[bytes], host_blocks: list[int]) -> None:
        self.service.write_to_disk(keys, host_blocks)

    def disk_written(self) -> tuple[list[bytes], list[bytes]]:
        return self.service.disk_written()

    def start_load_from_disk(self, load_id: str, keys: list[bytes], host_blocks: list[int]) -> None:
        self.service.start_load_from_disk(load_id, keys, host_blocks)

    def remove_from_disk(self, keys: list[bytes]) -> None:
        self.service.remove_from_disk(keys)

    def start_pull(self, load_id: str, addr: str, hashes: list[bytes], host_blocks: list[int],
                   deadline: float) -> None:
        self.service.start_pull(load_id, addr, hashes, host_blocks, deadline)

    def loads_done(self) -> list[LoadResult]:
        return self.service.loads_done()

    def forget_host_blocks(self) -> None:
        self.service.forget_host_blocks()

    def swap_in(self, transfer_id: str, buffer_blocks: list[int], cache_blocks: list[int]) -> None:
        self.service.swap_in(transfer_id, buffer_blocks, cache_blocks)

    def swaps_done(self) -> list[tuple[str, int, float]]:
        return []  # the service reports its swap-ins with its transfer reports, which the decode connector reads

    def stage_in(self, blocks: list[int]) -> None:
        pass  # P wrote into the cache itself
