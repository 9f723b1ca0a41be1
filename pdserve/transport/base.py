"""The transport interface: endpoints (what D advertises), writers (P side), receivers (D side)."""

from __future__ import annotations

import functools
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

ByteRange = tuple[int, int, int]  # (source offset, destination offset, nbytes)


RDMA_INSTALL = "pip install nixl-cu12==1.5.1 (after the pinned torch: it asks for an unpinned one)"


class TransferError(RuntimeError):
    pass


class IpcEndpoint(msgspec.Struct, tag="ipc", frozen=True):
    segment: str  # the shared-memory segment holding D's cache
    size: int
    host_id: str  # only a process on the same host (same boot) can map it

    protocol = "ipc"


class TcpEndpoint(msgspec.Struct, tag="tcp", frozen=True):
    host: str
    port: int

    protocol = "tcp"


class RdmaEndpoint(msgspec.Struct, tag="rdma", frozen=True):
    """A NIXL agent's address and memory keys (transport/nixl.py): whoever holds it can write into the
    registered memory, so it travels only inside sealed control messages."""

    agent: str
    metadata: bytes
    address: int  # the registered region in D's address space
    size: int
    gpu: int | None = None  # None: host memory; else the CUDA device holding the region (not run yet)

    protocol = "rdma"


Endpoint = IpcEndpoint | TcpEndpoint | RdmaEndpoint


HOST_ID_ENV = "PDSERVE_HOST_ID"


@functools.cache
def host_id() -> str:
    """Which host (and boot) this is: two processes may share memory only if theirs are equal.
    PDSERVE_HOST_ID (`pdserve serve --host-id`) overrides it, so one machine can stand in for many."""
    if explicit := os.environ.get(HOST_ID_ENV):
        return explicit
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class CacheBuffer:
    """A cache's bytes as the transports see them: a writable buffer and its address."""

    view: memoryview  # format "B", the whole cache
    address: int

    @property
    def size(self) -> int:
        return self.view.nbytes

    def check(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise TransferError(f"{what} range [{offset}, {offset + nbytes}) is outside the {self.size}-byte cache")


class KVWriter(ABC):
    """Writes ranges of the local cache into one peer's cache."""

    @abstractmethod
    def write(self, ranges: Sequence[ByteRange]) -> int:
        """Start (or do) the writes; returns the bytes written. Raises TransferError."""

    @abstractmethod
    def flush(self) -> None:
        """Return once every write so far is in the peer's memory. Raises TransferError."""

    @abstractmethod
    def close(self) -> None: ...

    def peer_gone(self) -> bool:
        """True once the peer's cache is known to be gone without a write failing (ipc: its segment was
        removed); the writer should then be closed."""
        return False


class KVReceiver(ABC):
    refused: int = 0  # connections that failed the cluster-secret challenge (a receiver that takes none: 0)

    @property
    @abstractmethod
    def endpoint(self) -> Endpoint: ...

    def close(self) -> None:  # noqa: B027 - most receivers hold nothing
        pass
