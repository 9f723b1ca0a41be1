"""KV transports: move byte ranges from this instance's cache buffer into a peer's.

`open_writer(endpoint, source)` gives the prefill side a `KVWriter`; `start_receiver(protocol, ...)`
gives the decode side whatever serves its endpoint (ipc needs nothing running: P maps D's segment).
A new transport (rdma) adds an endpoint type, a writer and, if it needs one, a receiver.
"""

from __future__ import annotations

from pdserve.transport.base import (
    CacheBuffer,
    Endpoint,
    IpcEndpoint,
    KVReceiver,
    KVWriter,
    TcpEndpoint,
    TransferError,
    host_id,
)

PROTOCOLS = ("ipc", "tcp")


def open_writer(endpoint: Endpoint, source: CacheBuffer) -> KVWriter:
    if isinstance(endpoint, IpcEndpoint):
        from pdserve.transport.ipc import IpcWriter

        return IpcWriter(endpoint, source)
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
    raise TransferError(f"unknown cache transfer protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")


def choose_endpoint(preferred: list[str], offered: list[Endpoint]) -> Endpoint | None:
    """The first protocol of ours (in our order) that the peer offers and that can reach it."""
    for protocol in preferred:
        for endpoint in offered:
            if endpoint.protocol != protocol:
                continue
            if isinstance(endpoint, IpcEndpoint) and endpoint.host_id != host_id():
                continue  # another host: its shared memory is out of reach
            return endpoint
    return None


__all__ = ["PROTOCOLS", "CacheBuffer", "Endpoint", "IpcEndpoint", "KVReceiver", "KVWriter", "TcpEndpoint",
           "TransferError", "choose_endpoint", "host_id", "open_writer", "start_receiver"]
