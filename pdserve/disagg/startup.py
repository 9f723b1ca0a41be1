"""The startup truth table (DESIGN section 2, seeds 000/001) as data, and the startup log.

Which process starts first and who creates the KV cache depends on three things: whether the block
count comes from a profile run (no --num-gpu-blocks-override), whether the role is mixed, and
whether prefix caching is on. The creator allocates the cache and raises *cache-ready*; the other
process attaches only after it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

    from pdserve.config import EngineConfig
    from pdserve.disagg.cache_service_client import CacheServiceClient
    from pdserve.disagg.kv_layout import KVLayout
    from pdserve.disagg.transport import Endpoint
    from pdserve.engine.worker_client import WorkerClient

WORKER, CACHE_SERVICE = "worker", "cache_service"

log = logging.getLogger("pdserve.startup")


@dataclass(frozen=True)
class StartupRow:
    order: tuple[str, ...]  # processes in start order
    cache_owner: str


#  (profile run, mixed role, prefix cache) -> row
TRUTH_TABLE: dict[tuple[bool, bool, bool], StartupRow] = {
    (True, True, True): StartupRow((WORKER, CACHE_SERVICE), WORKER),
    (True, True, False): StartupRow((WORKER,), WORKER),
    (True, False, True): StartupRow((WORKER, CACHE_SERVICE), CACHE_SERVICE),
    (True, False, False): StartupRow((WORKER, CACHE_SERVICE), CACHE_SERVICE),
    (False, True, True): StartupRow((WORKER, CACHE_SERVICE), WORKER),
    (False, True, False): StartupRow((WORKER,), WORKER),
    (False, False, True): StartupRow((CACHE_SERVICE, WORKER), CACHE_SERVICE),
    (False, False, False): StartupRow((CACHE_SERVICE, WORKER), CACHE_SERVICE),
}


def startup_row(profile_run: bool, role: str, prefix_caching: bool) -> StartupRow:
    return TRUTH_TABLE[(profile_run, role == "mixed", prefix_caching)]


class StartupLog:
    """What happened in which order, for people (the log) and tests (JSON lines in --startup-log)."""

    def __init__(self, path: str | None, row: StartupRow, key: tuple[bool, bool, bool]) -> None:
        self.path = path
        self.events: list[dict] = []
        self.record("plan", profile_run=key[0], mixed_role=key[1], prefix_caching=key[2], order=list(row.order),
                    cache_owner=row.cache_owner)

    def record(self, event: str, process: str | None = None, **detail: object) -> None:
        entry = {"t": time.time(), "event": event, **({"process": process} if process else {}), **detail}
        self.events.append(entry)
        log.info("startup: %s%s %s", event, f" {process}" if process else "",
                 " ".join(f"{k}={v}" for k, v in detail.items()))
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


# ---- starting an instance's processes in the table's order --------------------------------------


@dataclass
class StartedProcesses:
    worker: WorkerClient
    cache_service: CacheServiceClient | None
    layout: KVLayout
    max_model_len: int
    vocab_size: int
    profile: dict
    endpoints: list[Endpoint]  # what a prefill instance may write to (decode role)
    log: StartupLog
    segment: str | None = None  # the cache's shared-memory segment (CPU)

    def shutdown(self) -> None:
        for proc in (self.worker, self.cache_service):
            if proc is not None:
                proc.shutdown()
        remove_segment(self.segment)


def remove_segment(name: str | None) -> None:
    """The owner unlinks its segment when it exits; if it was killed (SIGKILL), the engine does."""
    if name and sys.platform.startswith("linux"):
        Path("/dev/shm", name).unlink(missing_ok=True)


def layout_without_profile(config: EngineConfig, num_blocks: int) -> KVLayout:
    """The cache layout from the model's config.json alone (no weights): for the rows where the
    cache service creates the cache before the worker has started. On a CPU it is worked out without
    torch; the worker's own layout is checked against it once it has loaded."""
    from pdserve.disagg.kv_layout import KVLayout
    from pdserve.loader import resolve_model_folder
    from pdserve.loader.hf_folder import read_config
    from pdserve.model_config import ModelConfig
    from pdserve.utils.dtype_names import cpu_kv_cache_dtype

    model = ModelConfig.from_hf_dict(read_config(resolve_model_folder(config.model)))
    dtype = cpu_kv_cache_dtype(config.device, config.dtype, config.kv_cache_dtype)
    if dtype is None:  # a GPU (or a name only torch can judge): ask torch
        import torch

        from pdserve.model.load import default_device, resolve_dtype, resolve_kv_cache_dtype

        device = torch.device(config.device) if config.device else default_device()
        dtype = str(resolve_kv_cache_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype, device)))
        dtype = dtype.removeprefix("torch.")
    return KVLayout(num_blocks, model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, dtype)


def start_processes(config: EngineConfig, ctx: zmq.Context, sockdir: str) -> StartedProcesses:
    """Start the worker and (per the table) the cache service; the cache owner creates the cache, the
    other attaches after *cache-ready*. Every wait has config.startup_timeout and names the process."""
    from pdserve.disagg.cache_service_client import CacheServiceClient
    from pdserve.disagg.messages import AttachCache, CreateCache
    from pdserve.engine.messages import CacheCommand
    from pdserve.engine.worker_client import WorkerClient

    key = (config.num_gpu_blocks_override is None, config.splitwise_role == "mixed", config.enable_prefix_caching)
    row = TRUTH_TABLE[key]
    slog = StartupLog(config.startup_log, row, key)
    timeout = config.startup_timeout
    worker = service = loaded = None
    layout = segment = messager_address = None
    endpoints: list[Endpoint] = []
    try:
        for name in row.order:
            slog.record("start", name)
            if name == WORKER:
                worker = WorkerClient(config, ctx, f"ipc://{sockdir}/w")
                loaded = worker.wait_loaded(timeout)
                slog.record("loaded", WORKER, num_blocks=loaded.layout.num_blocks, profile_run=bool(loaded.profile))
                if layout is not None and layout != loaded.layout:
                    raise RuntimeError(f"the worker's KV layout {loaded.layout} differs from the cache service's "
                                       f"{layout}")
                layout = loaded.layout
                if row.cache_owner == WORKER:
                    ready = worker.setup_cache(CacheCommand(create=True), timeout)
                    segment = ready.kv_cache_name
                    slog.record("cache_created", WORKER, segment=segment, num_blocks=layout.num_blocks)
                    slog.record("cache_ready", WORKER)
                elif segment is not None:  # the cache service came first and made the cache
                    worker.setup_cache(CacheCommand(False, segment, messager_address), timeout)
                    slog.record("cache_attached", WORKER, segment=segment)
            else:
                service = CacheServiceClient(config, ctx, f"ipc://{sockdir}/c",
                                             f"ipc://{sockdir}/m")
                if row.cache_owner == CACHE_SERVICE:
                    if layout is None:
                        layout = layout_without_profile(config, config.num_gpu_blocks_override)
                    ready = service.setup(CreateCache(layout), timeout)
                    segment, messager_address, endpoints = ready.segment, ready.messager_address, ready.endpoints
                    slog.record("cache_created", CACHE_SERVICE, segment=segment, num_blocks=layout.num_blocks)
                    slog.record("cache_ready", CACHE_SERVICE)
                    if worker is not None:  # loaded already, waiting for cache-ready
                        worker.setup_cache(CacheCommand(False, segment, messager_address), timeout)
                        slog.record("cache_attached", WORKER, segment=segment)
                else:
                    ready = service.setup(AttachCache(layout, segment), timeout)
                    slog.record("cache_attached", CACHE_SERVICE, segment=segment)
        slog.record("ready")
        return StartedProcesses(worker, service, layout, loaded.max_model_len, loaded.vocab_size, loaded.profile,
                                endpoints, slog, segment)
    except BaseException as e:
        slog.record("failed", error=str(e))
        for proc in (worker, service):
            if proc is not None:
                proc.shutdown()
        remove_segment(segment)
        raise
