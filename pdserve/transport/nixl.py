"""rdma: KV over NIXL (NVIDIA's inference transfer library, UCX underneath), what vLLM, SGLang and
Dynamo use between hosts: RDMA NICs and NVLink on a cluster. On one CPU box UCX picks cma (one kernel
copy from P's memory into D's) or, with UCX_TLS=tcp, its TCP transport.

D's side (`NixlReceiver`, in D's cache service) registers the memory P writes into (the cache, or the
splitwise buffer) with an agent and puts the agent's metadata -- its UCX address and memory keys --
into its endpoint. The endpoint reaches a prefill instance only inside D's sealed *cache info*, so
only a cluster member can add D as a remote agent. P's side has one agent per process (the cache
service's), P's cache registered once; a writer per decode instance adds D's agent once and posts one
WRITE per call: a descriptor list of the ranges, which the callers have coalesced (each descriptor
costs about 1 us here). NIXL's UCX backend flushes the endpoint before it reports a WRITE done, so
once flush() has seen every posted WRITE done the bytes are in D's memory, as for the other
transports; *prefill done* then tells D, with P's first token, which it needs anyway (so no NIXL
notification is sent).

UCX can crash the interpreter while it tears down at exit: a process that made an agent leaves
with `exit_now()` after its own cleanup.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pdserve.transport.base import ByteRange, CacheBuffer, KVReceiver, KVWriter, RdmaEndpoint, TransferError

log = logging.getLogger("pdserve.transport.nixl")

POLL_SECONDS = 50e-6

_agent: Any = None  # this process's agent (one per process; UCX workers are not cheap)
_agent_name = ""
_registered: dict[tuple[int, int], Any] = {}  # (address, size) -> registration


def _nixl() -> Any:
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            return __import__(name)
        except ImportError:
            continue
    from pdserve.transport.base import RDMA_INSTALL

    raise TransferError(f"the rdma transport needs NIXL: {RDMA_INSTALL}")


def local_agent() -> Any:
    global _agent, _agent_name
    if _agent is None:
        nixl = _nixl()
        name = f"pdserve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            # No NIXL progress thread: the Python API starts it with no delay, a core spinning for
            # good (and harder once a peer is gone). The writer progresses while it waits for its
            # WRITEs; a receiver runs a slow pump (ProgressPump).
            _agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:  # NIXL raises its own exception types
            raise TransferError(f"NIXL could not create its UCX agent: {e}") from None
        _agent_name = name
    return _agent


def memory_kind(gpu: int | None) -> tuple[str, int]:
    """NIXL's memory type and device id: host memory ("DRAM"), or a CUDA device's ("VRAM", its index).
    The VRAM side is the same calls with other descriptors; it has not run (no GPU here, and PD roles
    keep their cache in host shared memory today)."""
    return ("DRAM", 0) if gpu is None else ("VRAM", gpu)


def register(buffer: CacheBuffer, gpu: int | None = None) -> None:
    """Register a cache's memory with this process's agent (once per region)."""
    key = (buffer.address, buffer.size)
    if key not in _registered:
        agent = local_agent()
        mem, device = memory_kind(gpu)
        try:
            _registered[key] = agent.register_memory([(buffer.address, buffer.size, device, "")], mem)
        except Exception as e:
            raise TransferError(f"NIXL could not register {buffer.size} bytes of KV cache ({mem}): {e}") from None


def release() -> None:
    """Deregister every region (before the memory behind them is unmapped)."""
    for registration in _registered.values():
        try:
            _agent.deregister_memory(registration)
        except Exception:  # noqa: BLE001 - on the way out
            log.warning("NIXL could not deregister a KV region")
    _registered.clear()


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown when an agent exists (UCX may crash it there)."""
    if _agent is None:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class NixlReceiver(KVReceiver):
    """D's side: its memory registered, and UCX progressed so peers can connect and (over UCX's tcp,
    which emulates one-sided writes with messages) deliver."""

    PUMP_SECONDS = 0.001

    def __init__(self, destination: CacheBuffer, gpu: int | None = None) -> None:
        register(destination, gpu)
        agent = local_agent()
        self._endpoint = RdmaEndpoint(_agent_name, agent.get_agent_metadata(), destination.address, destination.size,
                                      gpu)
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._pump.start()

    @property
    def endpoint(self) -> RdmaEndpoint:
        return self._endpoint

    def close(self) -> None:
        self._stop.set()
        self._pump.join(1)

    def _progress(self) -> None:
        agent = local_agent()
        failures = 0
        while not self._stop.wait(self.PUMP_SECONDS):
            try:
                agent.get_new_notifs()  # progresses the UCX worker
            except Exception as e:  # noqa: BLE001 - a peer that died must not stop the others' transfers
                failures += 1
                if failures in (1, 100, 10000):
                    log.warning("NIXL progress failed (%d times so far): %s", failures, e)


class NixlWriter(KVWriter):
    def __init__(self, endpoint: RdmaEndpoint, source: CacheBuffer, timeout: float = 30.0,
                 gpu: int | None = None) -> None:
        register(source, gpu)
        self._agent = local_agent()
        self._src = source
        self._dst = endpoint
        self._src_mem, self._src_dev = memory_kind(gpu)
        self._dst_mem, self._dst_dev = memory_kind(endpoint.gpu)
        self._timeout = timeout
        self._pending: list[Any] = []
        try:
            self._peer = self._agent.add_remote_agent(endpoint.metadata)
        except Exception as e:
            raise TransferError(f"NIXL could not add the decode instance's agent {endpoint.agent}: {e}") from None

    def write(self, ranges: Sequence[ByteRange]) -> int:
        local, remote, total = [], [], 0
        for src, dst, n in ranges:
            self._src.check(src, n, "source")
            if dst < 0 or n < 0 or dst + n > self._dst.size:
                raise TransferError(f"destination range [{dst}, {dst + n}) is outside the {self._dst.size}-byte cache")
            if n:
                local.append((self._src.address + src, n, self._src_dev))
                remote.append((self._dst.address + dst, n, self._dst_dev))
                total += n
        if not local:
            return 0
        agent = self._agent
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, self._src_mem),
                                           agent.get_xfer_descs(remote, self._dst_mem), self._peer)
        except Exception as e:
            raise TransferError(f"NIXL could not prepare a WRITE to the decode instance: {e}") from None
        self._pending.append(handle)
        try:
            state = agent.transfer(handle)
        except Exception as e:
            raise TransferError(f"NIXL WRITE to the decode instance failed: {e}") from None
        if state == "ERR":
            raise TransferError("NIXL WRITE to the decode instance failed")
        return total

    def flush(self) -> None:
        deadline = time.monotonic() + self._timeout
        while self._pending:
            try:
                state = self._agent.check_xfer_state(self._pending[0])
            except Exception as e:
                state, error = "ERR", str(e)
            else:
                error = ""
            if state == "DONE":
                self._agent.release_xfer_handle(self._pending.pop(0))
            elif state == "ERR" or time.monotonic() > deadline:
                self._release_pending()
                raise TransferError(f"NIXL WRITE to the decode instance {'failed' if state == 'ERR' else 'timed out'}"
                                    + (f": {error}" if error else ""))
            else:
                time.sleep(POLL_SECONDS)

    def close(self) -> None:
        self._release_pending()
        try:
            self._agent.remove_remote_agent(self._peer)
        except Exception:  # noqa: BLE001 - the peer may be gone already
            pass

    def _release_pending(self) -> None:
        for handle in self._pending:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - NIXL refuses to release a transfer still in flight
                log.warning("a NIXL transfer handle could not be released")
        self._pending = []
