"""The startup truth table (DESIGN section 2, seeds 000/001) as steps, the loop that runs them, and the
startup log.

Which process starts first and who creates the KV cache depends on four things: whether the block
count comes from a profile run (no --num-gpu-blocks-override), whether the role is mixed, whether
prefix caching is on, and whether the cache is in device memory (CUDA; on a CPU the test mode
PDSERVE_PRIVATE_KV_CACHE=1). Each row of the table is the list of its steps in order; the creator
allocates the cache and raises *cache-ready*; the other process attaches only after it. A cache in
device memory is the worker's in every role: the cache service creates the host memory the
worker copies through (staging, decode buffer, host tier) first, and the worker maps it as it creates
the cache. The startup log (`--startup-log`) records each step as it runs, so a test compares it with
the row.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from pdserve.utils.shm_room import shm_room

if TYPE_CHECKING:
    import zmq

    from pdserve.config.engine import EngineConfig
    from pdserve.disagg.cache_service_client import CacheServiceClient
    from pdserve.engine.worker_client import WorkerClient
    from pdserve.kv.layout import KVLayout
    from pdserve.transport import Endpoint
    from pdserve.worker.protocol import WorkerLoaded

WORKER, CACHE_SERVICE = "worker", "cache_service"
# "1": a CPU worker keeps its cache in private memory, as a CUDA cache is, and every role takes the
# device cache's staging path (a test mode: tests run that path daily without a GPU)
PRIVATE_CACHE_ENV = "PDSERVE_PRIVATE_KV_CACHE"

log = logging.getLogger("pdserve.startup")


class Step(enum.Enum):
    """One step of an instance's start; a row of the table lists them in order."""

    START_WORKER = "start the worker: it loads the weights, runs the profile run if any, reports its layout"
    START_CACHE_SERVICE = "start the cache service"
    WORKER_CREATES_CACHE = "the worker creates the cache and raises cache-ready"
    SERVICE_CREATES_CACHE = "the cache service creates the cache and raises cache-ready"
    WORKER_ATTACHES = "the worker attaches to the cache"
    SERVICE_ATTACHES = "the cache service attaches to the cache"
    SERVICE_CREATES_HOST_MEMORY = ("the cache service creates the host memory a device cache is copied through "
                                   "(PD: staging; the decode buffer; the host tier) and raises host-ready")


_W, _C = Step.START_WORKER, Step.START_CACHE_SERVICE
WORKER_OWNS = (_W, Step.WORKER_CREATES_CACHE, _C, Step.SERVICE_ATTACHES)
WORKER_ALONE = (_W, Step.WORKER_CREATES_CACHE)
PROFILE_THEN_SERVICE = (_W, _C, Step.SERVICE_CREATES_CACHE, Step.WORKER_ATTACHES)
SERVICE_FIRST = (_C, Step.SERVICE_CREATES_CACHE, _W, Step.WORKER_ATTACHES)
DEVICE_CACHE = (_W, _C, Step.SERVICE_CREATES_HOST_MEMORY, Step.WORKER_CREATES_CACHE)

class Row(NamedTuple):
    """Which row of the table an instance starts by."""

    profile_run: bool  # the block count is measured (no --num-gpu-blocks-override)
    mixed_role: bool
    prefix_caching: bool
    device_cache: bool  # the worker's cache is private to it (CUDA, or the CPU test mode)


#  Row -> steps. A cache in host shared
#  memory: mixed, the worker owns it (nothing is sent), and without prefix caching it runs alone; PD,
#  the cache service owns it (it sends or receives KV), after the worker's profile run when there is
#  one (the block count comes from it), else first. A cache in device memory: the worker owns it in
#  every role, after the cache service made the host memory it maps (a mixed instance without prefix
#  caching has none and runs alone; with it, the service starts only for a host tier, --swap-space).
TRUTH_TABLE: dict[Row, tuple[Step, ...]] = {
    Row(True, True, True, False): WORKER_OWNS,
    Row(True, True, False, False): WORKER_ALONE,
    Row(True, False, True, False): PROFILE_THEN_SERVICE,
    Row(True, False, False, False): PROFILE_THEN_SERVICE,
    Row(False, True, True, False): WORKER_OWNS,
    Row(False, True, False, False): WORKER_ALONE,
    Row(False, False, True, False): SERVICE_FIRST,
    Row(False, False, False, False): SERVICE_FIRST,
    Row(True, True, True, True): DEVICE_CACHE,
    Row(True, True, False, True): WORKER_ALONE,
    Row(True, False, True, True): DEVICE_CACHE,
    Row(True, False, False, True): DEVICE_CACHE,
    Row(False, True, True, True): DEVICE_CACHE,
    Row(False, True, False, True): WORKER_ALONE,
    Row(False, False, True, True): DEVICE_CACHE,
    Row(False, False, False, True): DEVICE_CACHE,
}


def cache_owner(steps: tuple[Step, ...]) -> str:
    return WORKER if Step.WORKER_CREATES_CACHE in steps else CACHE_SERVICE


def cache_in_device_memory(config: EngineConfig) -> bool:
    """The worker's cache is private to it: CUDA, or the CPU test mode. Decided before any process
    starts (the row depends on it); torch is imported only where a GPU device node exists and no
    --device was given, and the worker refuses a plan that does not match its device."""
    if os.environ.get(PRIVATE_CACHE_ENV) == "1":
        return True
    if config.device:
        return not config.device.startswith("cpu")
    from pdserve.utils.dtype_names import gpu_present

    if not gpu_present():
        return False
    import torch

    return torch.cuda.is_available()


def processes(steps: tuple[Step, ...]) -> list[str]:
    """The processes in start order."""
    return [WORKER if step is _W else CACHE_SERVICE for step in steps if step in (_W, _C)]


class StartupLog:
    """What happened in which order, for people (the log) and tests (JSON lines in --startup-log)."""

    def __init__(self, path: str | None, steps: tuple[Step, ...], row: Row) -> None:
        self.path = path
        self.events: list[dict] = []
        self.record("plan", **row._asdict(), steps=[step.name for step in steps])

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
    buffer_blocks: int = 0  # decode role: blocks of the splitwise cache buffer P writes into
    buffer_segment: str | None = None
    host_blocks: int = 0  # --swap-space: blocks of the host prefix tier
    host_segment: str | None = None
    device_cache: bool = False  # the worker's cache is private (CUDA, or the CPU test mode)
    disk_folder: str | None = None  # --kv-disk-path: this producer's folder (kv/disk_store.py)
    pull_port: int | None = None  # --enable-kv-pull: the cache service's block server

    def shutdown(self) -> None:
        for proc in (self.worker, self.cache_service):
            if proc is not None:
                proc.shutdown()
        for segment in (self.segment, self.buffer_segment, self.host_segment):
            remove_segment(segment)


def gigabytes_in_blocks(flag: str, gigabytes: float, layout: KVLayout) -> int:
    """A host memory flag (--splitwise-cache-buffer-size, --swap-space) in blocks of the cache's layout
    (0: not asked for)."""
    if not gigabytes:
        return 0
    blocks = int(gigabytes * 2**30) // layout.block_bytes
    if blocks < 1:
        raise ValueError(f"{flag} {gigabytes:g} GB holds no {layout.block_bytes / 2**20:.1f} MiB block of this "
                         f"model's KV cache")
    return blocks


def remove_segment(name: str | None) -> None:
    """The owner unlinks its segment when it exits; if it was killed (SIGKILL), the engine does."""
    if name and sys.platform.startswith("linux"):
        Path("/dev/shm", name).unlink(missing_ok=True)


def layout_without_profile(config: EngineConfig, num_blocks: int) -> KVLayout:
    """The cache layout from the model's config.json alone (no weights): for the rows where the
    cache service creates the cache before the worker has started. On a CPU it is worked out without
    torch; the worker's own layout is checked against it once it has loaded."""
    from pdserve.config.layer_groups import layer_groups_for
    from pdserve.config.model import ModelConfig
    from pdserve.kv.layout import KVLayout
    from pdserve.loader import resolve_model_folder
    from pdserve.loader.hf_folder import read_config
    from pdserve.utils.dtype_names import cpu_kv_cache_dtype

    model = ModelConfig.from_hf_dict(read_config(resolve_model_folder(config.model)))
    dtype = cpu_kv_cache_dtype(config.device, config.dtype, config.kv_cache_dtype)
    if dtype is None:  # a GPU (or a name only torch can judge): ask torch
        import torch

        from pdserve.model.load import default_device, resolve_dtype, resolve_kv_cache_dtype

        device = torch.device(config.device) if config.device else default_device()
        dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype, device))
    groups = layer_groups_for(model, config.one_block_table_reason())
    return KVLayout.for_model(model, num_blocks, config.block_size, dtype, groups)


def kv_fingerprint(config: EngineConfig, layout: KVLayout) -> str:
    """What produced this instance's KV bytes: the weights' digest and how they are computed on (--quantization),
    the KV dtype, the layout and the block size. The disk tier's folder is named by it and prefix pulls match it,
    so no other producer reads these blocks."""
    from pdserve.kv.disk_store import fingerprint
    from pdserve.loader import resolve_model_folder
    from pdserve.loader.quantization import requested_quantization
    from pdserve.loader.weights_digest import weights_digest

    quantization = requested_quantization(config.quantization, config.model)
    digest = f"{weights_digest(resolve_model_folder(config.model))}:{quantization}"
    if layout.layer_groups is not None:  # a block holds one group's layers: which ones is part of its bytes' meaning
        digest += f":groups={layout.layer_groups.layers}"
    shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    return fingerprint(digest, layout.dtype, shape, layout.block_size)




def start_processes(config: EngineConfig, ctx: zmq.Context, sockdir: str) -> StartedProcesses:
    """Run the table's row for this config, step by step; every wait has config.startup_timeout and
    names the process. On failure, what was started is stopped and the segment removed."""
    from pdserve.loader import tensor_parallel_refusal

    if refusal := tensor_parallel_refusal(config.model, config.tensor_parallel_size):  # before any process
        raise ValueError(refusal)
    row = Row(config.num_gpu_blocks_override is None, not config.has_pd_parts, config.enable_prefix_caching,
              cache_in_device_memory(config))
    steps = TRUTH_TABLE[row]
    start = _Startup(config, ctx, sockdir, StartupLog(config.startup_log, steps, row), row.device_cache)
    try:
        for step in steps:
            if start.service_has_nothing_to_keep(step):
                continue
            start.log.record("step", step=step.name)
            STEP_ACTIONS[step](start)
        start.log.record("ready")
        return start.result()
    except BaseException as e:
        start.log.record("failed", error=str(e))
        for proc in (start.worker, start.service):
            if proc is not None:  # SIGTERM: a worker still importing or loading reads no message (it waited 10 s)
                proc.shutdown(ask=False)
        for segment in (start.segment, start.buffer_segment, start.host_segment):
            remove_segment(segment)
        raise


class _Startup:
    """What the steps share; one method per Step (STEP_ACTIONS)."""

    def service_has_nothing_to_keep(self, step: Step) -> bool:
        """A mixed instance whose cache is in device memory needs the cache service only for a host tier
        (--swap-space); without one it is not started, and the log says so."""
        if not self.device_cache or self.config.has_pd_parts or self.config.swap_space:
            return False
        if step is Step.START_CACHE_SERVICE:
            self.log.record("cache_service_not_started", reason="the worker's KV cache is in device memory "
                            "and there is no host tier (--swap-space): a mixed instance's cache service has "
                            "nothing to keep")
        return step in (Step.START_CACHE_SERVICE, Step.SERVICE_CREATES_HOST_MEMORY)

    def __init__(self, config: EngineConfig, ctx: zmq.Context, sockdir: str, slog: StartupLog,
                 device_cache: bool) -> None:
        self.config, self.ctx, self.sockdir, self.log = config, ctx, sockdir, slog
        self.device_cache = device_cache
        self.timeout = config.startup_timeout
        self.worker: WorkerClient | None = None
        self.service: CacheServiceClient | None = None
        self.loaded: WorkerLoaded | None = None
        self.layout: KVLayout | None = None
        self.segment: str | None = None
        self.messager_address: str | None = None
        self.disk_folder: str | None = None
        self.fingerprint: str | None = None
        self.pull_port: int | None = None
        self.endpoints: list[Endpoint] = []
        self.buffer_blocks = 0
        self.buffer_segment: str | None = None
        self.host_blocks = 0
        self.host_segment: str | None = None

    def start_worker(self) -> None:
        from pdserve.engine.worker_client import WorkerClient

        self.worker = WorkerClient(self.config, self.ctx, f"ipc://{self.sockdir}/w")
        self.loaded = self.worker.wait_loaded(self.timeout)
        self.log.record("loaded", WORKER, num_blocks=self.loaded.layout.num_blocks,
                        profile_run=bool(self.loaded.profile), weights_resident=self.worker.weights_resident)
        if self.layout is not None and self.layout != self.loaded.layout:
            raise RuntimeError(f"the worker's KV layout {self.loaded.layout} differs from the cache service's "
                               f"{self.layout}")
        self.layout = self.loaded.layout

    def start_cache_service(self) -> None:
        from pdserve.disagg.cache_service_client import CacheServiceClient

        self.service = CacheServiceClient(self.config, self.ctx, f"ipc://{self.sockdir}/c", f"ipc://{self.sockdir}/m")

    def worker_creates_cache(self) -> None:
        from pdserve.worker.protocol import CacheCommand, HostSegment

        if not self.device_cache:
            self.segment = self.worker.setup_cache(CacheCommand(create=True), self.timeout).kv_cache_name
            self.log.record("cache_created", WORKER, segment=self.segment, num_blocks=self.layout.num_blocks)
            return
        mine = [HostSegment(role, name, n) for role, name, n in (
            ("staging", self.segment, self.layout.num_blocks), ("buffer", self.buffer_segment, self.buffer_blocks),
            ("host", self.host_segment, self.host_blocks)) if name is not None]
        command = CacheCommand(True, None, self.messager_address, private=True, host_segments=mine,
                               num_blocks=self.layout.num_blocks)
        self.worker.setup_cache(command, self.timeout)
        self.log.record("cache_created", WORKER, segment=None, num_blocks=self.layout.num_blocks,
                        host_memory=[s.role for s in mine])

    def service_creates_host_memory(self) -> None:
        """The host memory of a device cache: PD roles get a staging segment of the cache's layout (the
        cache's block ids; P sends from it, D receives into it) unless D receives into its decode buffer;
        and the host tier."""
        staging = self.config.has_pd_parts and not self.config.splitwise_cache_buffer_size
        self._size_host_memory()
        if staging and not self.config.num_gpu_blocks_override:
            self._fit_staging_in_host_memory()
        self._create_in_service(staging=staging)
        self.log.record("host_memory_created", CACHE_SERVICE, staging=self.segment,
                        buffer_blocks=self.buffer_blocks, host_blocks=self.host_blocks)

    def _fit_staging_in_host_memory(self) -> None:
        """A profiled device cache gets no more blocks than its staging mirror can hold filled in
        /dev/shm (with the buffer and host tier beside it): a GPU's cache can be larger than the host's
        shared memory, and a staging write past a full /dev/shm would kill the cache service."""
        room = shm_room()
        if room is None:
            return
        fits = room // self.layout.block_bytes - self.buffer_blocks - self.host_blocks
        if 0 < fits < self.layout.num_blocks:
            log.warning("KV cache capped at %d blocks (profiled %d): its host staging must fit the %.2f GiB "
                        "/dev/shm has left", fits, self.layout.num_blocks, room / 2**30)
            self.layout = self.layout.with_blocks(fits)

    def service_creates_cache(self) -> None:
        if self.layout is None:  # no worker yet: the layout from config.json
            self.layout = layout_without_profile(self.config, self.config.num_gpu_blocks_override)
        self._size_host_memory()
        self._create_in_service(staging=True)
        self.log.record("cache_created", CACHE_SERVICE, segment=self.segment, num_blocks=self.layout.num_blocks,
                        **({"buffer_blocks": self.buffer_blocks} if self.buffer_blocks else {}),
                        **({"host_blocks": self.host_blocks} if self.host_blocks else {}))

    def _size_host_memory(self) -> None:
        self.buffer_blocks = gigabytes_in_blocks("--splitwise-cache-buffer-size",
                                                 self.config.splitwise_cache_buffer_size, self.layout)
        self.host_blocks = gigabytes_in_blocks("--swap-space", self.config.swap_space, self.layout)

    def _create_in_service(self, staging: bool) -> None:
        from pdserve.disagg.messages import CreateCache

        command = CreateCache(self.layout, self.buffer_blocks, self.host_blocks, cache_segment=staging,
                              disk_folder=self._disk_folder(), fingerprint=self._fingerprint())
        ready = self.service.setup(command, self.timeout)
        self.segment, self.messager_address, self.endpoints = ready.segment, ready.messager_address, ready.endpoints
        self.buffer_segment, self.host_segment = ready.buffer_segment, ready.host_segment
        self.pull_port = ready.pull_port

    def worker_attaches(self) -> None:
        from pdserve.worker.protocol import CacheCommand

        self.worker.setup_cache(CacheCommand(False, self.segment, self.messager_address), self.timeout)
        self.log.record("cache_attached", WORKER, segment=self.segment)

    def service_attaches(self) -> None:
        from pdserve.disagg.messages import AttachCache

        self.host_blocks = gigabytes_in_blocks("--swap-space", self.config.swap_space, self.layout)
        ready = self.service.setup(AttachCache(self.layout, self.segment, self.host_blocks, self._disk_folder(),
                                               self._fingerprint()), self.timeout)
        self.host_segment, self.pull_port = ready.host_segment, ready.pull_port
        self.log.record("cache_attached", CACHE_SERVICE, segment=self.segment,
                        **({"host_blocks": self.host_blocks} if self.host_blocks else {}))

    def _fingerprint(self) -> str | None:
        """The KV bytes' producer, for the disk tier and prefix pulls (None: neither is on)."""
        if self.config.kv_disk_path is None and not self.config.enable_kv_pull:
            return None
        if self.fingerprint is None:
            self.fingerprint = kv_fingerprint(self.config, self.layout)
        return self.fingerprint

    def _disk_folder(self) -> str | None:
        """--kv-disk-path's folder for these weights, this KV dtype and layout (their fingerprint)."""
        if self.config.kv_disk_path is None:
            return None
        if self.disk_folder is None:
            self.disk_folder = str(Path(self.config.kv_disk_path) / self._fingerprint())
            self.log.record("disk_tier", folder=self.disk_folder)
        return self.disk_folder

    def result(self) -> StartedProcesses:
        return StartedProcesses(
            worker=self.worker, cache_service=self.service, layout=self.layout,
            max_model_len=self.loaded.max_model_len, vocab_size=self.loaded.vocab_size, profile=self.loaded.profile,
            endpoints=self.endpoints, log=self.log, segment=self.segment, buffer_blocks=self.buffer_blocks,
            buffer_segment=self.buffer_segment, host_blocks=self.host_blocks, host_segment=self.host_segment,
            device_cache=self.device_cache, disk_folder=self.disk_folder, pull_port=self.pull_port)


# What each step does: one method of _Startup per Step.
STEP_ACTIONS: dict[Step, Callable[[_Startup], None]] = {
    Step.START_WORKER: _Startup.start_worker,
    Step.START_CACHE_SERVICE: _Startup.start_cache_service,
    Step.WORKER_CREATES_CACHE: _Startup.worker_creates_cache,
    Step.SERVICE_CREATES_CACHE: _Startup.service_creates_cache,
    Step.WORKER_ATTACHES: _Startup.worker_attaches,
    Step.SERVICE_ATTACHES: _Startup.service_attaches,
    Step.SERVICE_CREATES_HOST_MEMORY: _Startup.service_creates_host_memory,
}
