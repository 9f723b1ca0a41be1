"""The engine's answers to utility calls (messages.Utility): figures, debug checks, weights, roles, LoRA adapters.

One handler per call type; a failure the caller should see is an exception of a known type, answered as the
call's error. Anything else is a bug and ends the engine as any bug does."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from pdserve.admission.load import LoadTracker
from pdserve.config.roles import Role
from pdserve.engine.block_pool import KVBlocksLeaked
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import CacheService
from pdserve.engine.messages import (
    CheckIdle,
    ClearWeights,
    GetStats,
    LoadLoRA,
    LoadWeights,
    RequestOutput,
    ResetPrefixCache,
    SetRole,
    UnloadLoRA,
    UtilityCall,
    UtilityResult,
)
from pdserve.engine.request import Request
from pdserve.engine.request_output import final_output
from pdserve.engine.role_connectors import RoleConnectors
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stats import EngineStats, copied
from pdserve.engine.tier_upkeep import TierUpkeep
from pdserve.engine.worker_client import WorkerClient, WorkerFailed
from pdserve.kv.layout import KVLayout

log = logging.getLogger("pdserve.engine")


class CallRefused(Exception):
    """The call cannot be carried out now or as asked (a role the instance cannot take, an adapter in use)."""


class Engine(Protocol):
    """What the utility calls read and change of the engine core."""

    scheduler: Scheduler
    kv: KVCacheManager
    connector: RoleConnectors
    worker: WorkerClient
    cache_service: CacheService
    layout: KVLayout
    tiers: TierUpkeep
    load: LoadTracker
    weights_loaded: bool
    loras: set[str]
    num_steps: int
    num_computed_tokens: int

    def abort(self, request_id: str) -> Request | None: ...


class EngineUtilities:
    def __init__(self, core: Engine) -> None:
        self.core = core
        self._handlers: dict[type, Callable] = {
            GetStats: lambda _: UtilityResult(0, stats=self.stats()), CheckIdle: self._check_idle,
            ResetPrefixCache: self._reset_prefix_cache, ClearWeights: self._clear_weights,
            LoadWeights: self._load_weights, SetRole: self._set_role, LoadLoRA: self._load_lora,
            UnloadLoRA: self._unload_lora}
        self._aborted: list[RequestOutput] = []

    def answer(self, call: UtilityCall) -> tuple[UtilityResult, list[RequestOutput]]:
        """The call's result, and the outputs of requests it ended (ClearWeights aborts all)."""
        self._aborted = []
        try:
            result = self._handlers[type(call.call)](call.call)
        except (WorkerFailed, CallRefused, KVBlocksLeaked) as e:
            result = UtilityResult(0, error=str(e))
        result.call_id = call.call_id
        return result, self._aborted

    def stats(self) -> EngineStats:
        """Copies of the components' figures (they go on adding to their own), levels read now."""
        core = self.core
        pool, kv, scheduler = core.kv.pool, core.kv, core.scheduler
        return EngineStats(
            num_blocks=pool.num_blocks, free_blocks=pool.num_free_blocks, cached_blocks=pool.num_cached_blocks,
            kv_usage=pool.usage(), running=len(scheduler.running), waiting=len(scheduler.waiting),
            preallocated=len(scheduler.preallocated), num_preemptions=scheduler.num_preemptions,
            num_steps=core.num_steps, num_computed_tokens=core.num_computed_tokens,
            prefix_cache=copied(kv.stats), weights_loaded=core.weights_loaded,
            host_tier=None if kv.host is None else copied(kv.host.stats, blocks=kv.host.num_blocks,
                                                          blocks_used=kv.host.num_used_blocks),
            disk_tier=None if kv.disk is None else copied(kv.disk.stats, blocks=len(kv.disk),
                                                          capacity_blocks=kv.disk.capacity_blocks),
            prefix_pulls=None if kv.pulls is None else copied(kv.pulls.stats, bandwidth=kv.pulls.bandwidth),
            prefill_rate=core.load.prompt_step_rate, spec_decode=scheduler.spec_decode_counts(),
            layer_groups=None if kv.groups is None else kv.groups.use(scheduler.requests.values()),
            pd=core.connector.stats())

    def _check_idle(self, _: CheckIdle) -> UtilityResult:
        if n := self.core.scheduler.num_unfinished:
            raise CallRefused(f"{n} requests are still unfinished")
        self.core.tiers.wait_for_host_saves()
        self.core.kv.pool.check_all_free()
        return UtilityResult(0, stats=self.stats())

    def _reset_prefix_cache(self, _: ResetPrefixCache) -> UtilityResult:
        self.core.kv.reset_prefix_cache()
        return UtilityResult(0, {})

    def _clear_weights(self, _: ClearWeights) -> UtilityResult:
        core = self.core
        self._aborted = [final_output(r) for rid in list(core.scheduler.requests) if (r := core.abort(rid))]
        core.kv.reset_prefix_cache()  # cached KV dies with the cache memory
        core.weights_loaded = False
        core.tiers.finish_copies()  # the aborts' host-tier saves, while the cache still exists
        core.worker.weights("clear")
        core.cache_service.worker_cache_freed()
        return UtilityResult(0, {"aborted": len(self._aborted)})

    def _load_weights(self, _: LoadWeights) -> UtilityResult:
        core = self.core
        ok = core.worker.weights("load")
        core.cache_service.worker_cache_created(core.layout, ok.kv_cache_name)
        core.weights_loaded = True
        return UtilityResult(0, {})

    def _set_role(self, call: SetRole) -> UtilityResult:
        """Change role in place (--enable-role-switch): the weights and the KV cache (its prefix index too) stay,
        and what is in flight goes on (role_connectors.py)."""
        try:
            role = Role(call.role)
        except ValueError:
            raise CallRefused(f"role must be one of {', '.join(Role)}") from None
        connector, scheduler = self.core.connector, self.core.scheduler
        if (why := connector.can_take(role)) is not None:
            raise CallRefused(why)
        before, connector.role = connector.role, role
        scheduler.set_role(role)
        log.info("role changed in place: %s -> %s (%d requests and %d transfers in flight go on)", before, role,
                 scheduler.num_unfinished, connector.held)
        return UtilityResult(0, {"role": str(role), "sides": connector.sides})

    def _load_lora(self, call: LoadLoRA) -> UtilityResult:
        self.core.worker.lora("load", call.name, call.path)
        self.core.loras.add(call.name)
        return UtilityResult(0, {})

    def _unload_lora(self, call: UnloadLoRA) -> UtilityResult:
        if in_use := sum(1 for r in self.core.scheduler.requests.values() if r.lora_name == call.name):
            raise CallRefused(f"LoRA adapter {call.name!r} is in use by {in_use} requests")
        self.core.worker.lora("unload", call.name)
        self.core.loras.discard(call.name)
        return UtilityResult(0, {})

