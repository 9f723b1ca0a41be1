"""The engine's composition root: an EngineCore built whole from what startup gave (startup.py).

The PD connectors (pdserve.disagg) implement the engine's contract (engine/kv_connector.py); here, above
both, they are plugged in, so the engine never imports pdserve.disagg.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.config.roles import Role
from pdserve.disagg.decode_connector import DecodeConnector
from pdserve.disagg.prefill_connector import PrefillConnector
from pdserve.engine.block_copies import BlockCopies, ServiceCopies
from pdserve.engine.disk_tier import DiskTier
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVConnector, NoCacheService
from pdserve.engine.load_calibration import calibrate_load
from pdserve.engine.prefix_pull import PullCost
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.worker_copies import WorkerCopies
from pdserve.kv.disk_store import DiskFiles
from pdserve.kv_events.publisher import KVEventPublisher

if TYPE_CHECKING:
    import zmq

    from pdserve.config.engine import EngineConfig
    from pdserve.instance.startup import StartedProcesses

log = logging.getLogger("pdserve.engine")


def open_disk_tier(folder: str, block_bytes: int, size: int) -> DiskTier:
    """The disk tier's index from its folder (a warm restart finds its blocks); files past the size go now."""
    files = DiskFiles(Path(folder), block_bytes)
    found = files.scan()
    capacity = size // files.file_bytes
    if capacity < 1:
        raise ValueError(f"--kv-disk-size {size} bytes holds no {files.file_bytes}-byte block of this model's KV")
    for key in found[:max(0, len(found) - capacity)]:
        files.remove(key)
    log.info("disk KV tier %s: %d blocks found, room for %d", folder, min(len(found), capacity), capacity)
    return DiskTier(capacity, found[-capacity:])


def build_engine_core(config: EngineConfig, started: StartedProcesses, ctx: zmq.Context) -> EngineCore:
    layout = started.layout
    kv = KVCacheManager(layout.num_blocks, config.block_size, config.enable_prefix_caching, layout.layer_groups)
    scheduler = Scheduler(SchedulerConfig.of(config, started.max_model_len, started.vocab_size), kv)
    service = started.cache_service or NoCacheService()
    # Only the worker reaches a cache in device memory: it runs the copies; else the cache service does.
    copies: BlockCopies = (WorkerCopies(layout.block_bytes, started.cache_service) if started.device_cache
                           else ServiceCopies(service))
    if started.host_blocks:
        kv.add_host_tier(started.host_blocks, copies)
    if started.disk_folder is not None:
        kv.add_disk_tier(open_disk_tier(started.disk_folder, layout.block_bytes, config.kv_disk_size))
    connectors: dict[Role, KVConnector] = {}
    if config.splitwise_role == Role.PREFILL or config.enable_role_switch:
        connectors[Role.PREFILL] = PrefillConnector(config, scheduler, layout, ctx, started.cache_service)
    if config.splitwise_role == Role.DECODE or config.enable_role_switch:
        connectors[Role.DECODE] = DecodeConnector(config, scheduler, layout, ctx, started.endpoints,
                                                  started.cache_service, buffer_blocks=started.buffer_blocks,
                                                  copies=copies)
    publisher = None
    if config.kv_events_config is not None and config.kv_events_config.enabled:
        kv.record_events()
        publisher = KVEventPublisher(config.kv_events_config, kv.snapshot, ctx, config.data_parallel_rank)
    core = EngineCore(config, started.worker, scheduler, layout, copies, connectors, service, publisher)
    if config.enable_kv_pull:
        cost = PullCost(layout.block_bytes, config.block_size, lambda: core.load.prompt_step_rate)
        kv.add_prefix_pulls(cost)
        log.info("prefix pulls: a peer's block server named by a router is asked for a prefix when it is cheaper "
                 "than computing it; at start %s", cost.describe())
    if config.calibrate_load:
        calibrate_load(core.load, started.worker, config, layout.num_blocks, started.max_model_len)
    return core
