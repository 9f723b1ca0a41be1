"""KV transports: move byte ranges from this instance's cache buffer into a peer's.

`open_writer(endpoint, source)` gives the prefill side a `KVWriter`; `start_receiver(protocol, ...)`
gives the decode side whatever serves its endpoint (ipc needs nothing running: P maps D's segment).
A transport is an endpoint type, a writer and, if it needs one, a receiver: ipc (same host, P maps D's
segment), tcp (any host, our own stream), rdma (NIXL over UCX, optional: `pip install nixl-cu12`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.transport.base import (
    RDMA_INSTALL,
    CacheBuffer,
    Endpoint,
    IpcEndpoint,
    KVReceiver,
    KVWriter,
    RdmaEndpoint,
    TcpEndpoint,
    TransferError,
    host_id,
)

PROTOCOLS = ("ipc", "tcp", "rdma")


def rdma_available() -> bool:
    """NIXL is installed (the rdma transport is an optional dependency)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl_cu13", "nixl"))


def open_writer(endpoint: Endpoint, source: CacheBuffer) -> KVWriter:
    if isinstance(endpoint, IpcEndpoint):
        from pdserve.transport.ipc import IpcWriter

        return IpcWriter(endpoint, source)
    if isinstance(endpoint, RdmaEndpoint):
        from pdserve.transport.nixl import NixlWriter

        return NixlWriter(endpoint, source)
    from pdserve.transport.tcp import TcpWriter

    return TcpWriter(endpoint, source)


def start_receiver(protocol: str, destination: CacheBuffer, segment: str | None, host: str,
                   advertise_host: str | None = None) -> KVReceiver:
    if protocol == "ipc":
        from pdserve.transport.ipc import IpcReceiver

        if segment is None:
            raise TransferError("the ipc transport needs the KV cache in a shared-memory segment")
        return IpcReceiver(segment, destination.size)
    if protocol == "tcp":
        from pdserve.transport.tcp import TcpReceiver

        return TcpReceiver(destination, host, advertise_host=advertise_host)
    if protocol == "rdma":
        from pdserve.transport.nixl import NixlReceiver

        return NixlReceiver(destination)
    raise TransferError(f"unknown cache transfer protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")


def choose_protocol(preferred: Sequence[str], offered: Sequence[str], same_host: bool) -> str | None:
    """The one transport choice, made by the router for a pair and by P for D's endpoints: the first
    protocol of P's (in P's order) that D offers; ipc only when both are on one host (same host id:
    one host has many names, and two loopback addresses may stand for two hosts)."""
    for protocol in preferred:
        if protocol in offered and (protocol != "ipc" or same_host):
            return protocol
    return None


def choose_endpoint(preferred: Sequence[str], offered: list[Endpoint]) -> Endpoint | None:
    """D's endpoint of the chosen protocol, from P's side (P's host id decides ipc's reach)."""
    same_host = any(isinstance(e, IpcEndpoint) and e.host_id == host_id() for e in offered)
    protocol = choose_protocol(preferred, [e.protocol for e in offered], same_host)
    return next((e for e in offered if e.protocol == protocol), None)


__all__ = ["PROTOCOLS", "RDMA_INSTALL", "CacheBuffer", "Endpoint", "IpcEndpoint", "KVReceiver", "KVWriter",
           "RdmaEndpoint", "TcpEndpoint", "TransferError", "choose_endpoint", "choose_protocol", "host_id",
           "open_writer", "rdma_available", "start_receiver"]
