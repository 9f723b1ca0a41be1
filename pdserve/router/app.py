"""The router's HTTP face: the state its routes share, built from the settings, and the routes per concern
(routes/membership.py, routes/openai.py, routes/operations.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import aiohttp
from fastapi import FastAPI

from pdserve.admission.metrics import AdmissionMetrics
from pdserve.admission.settings import admission_from_flags
from pdserve.balancing.policies import Policy, make_policy
from pdserve.http.auth import bearer_auth
from pdserve.http.wire import Registration
from pdserve.kv_events.index import KVIndex
from pdserve.kv_events.subscriber import KVEventSubscriber
from pdserve.router.admission import LoadPoller, RouterAdmission
from pdserve.router.forward import Forwarder
from pdserve.router.health import HealthChecker
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefill_decider import PrefillDecider
from pdserve.router.prompt import PromptReader
from pdserve.router.registry import Registry
from pdserve.router.routes import membership, openai, operations
from pdserve.router.selector import Selector
from pdserve.router.settings import RouterSettings
from pdserve.router.state import RouterState
from pdserve.utils.cluster_auth import SignatureCheck

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from pdserve.router.tracing import RouterTracing


def build_router_app(settings: RouterSettings, reader: PromptReader,
                     static_instances: Iterable[Registration] = ()) -> FastAPI:
    """`static_instances` (--instances) are in the pool from the start, without heartbeats."""
    state = _router_state(settings, reader)
    static_instances = list(static_instances)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=settings.request_timeout, sock_connect=5.0),
            auto_decompress=False)  # bytes pass through as the instance sent them
        state.checker = HealthChecker(state.registry, client, settings.health_interval, settings.health_timeout)
        admission = state.admission
        state.forwarder = Forwarder(client, state.registry, state.selector, settings.max_retries,
                                    state.metrics.retries.inc, settings.migration_limit, state.metrics.count_migration,
                                    state.metrics.count_cached,
                                    admission.routed if admission is not None else lambda route, request: None,
                                    state.kv_events.index)
        for info in static_instances:
            state.registry.register(info, static=True)
        tasks = [asyncio.create_task(state.checker.run())]
        if admission is not None and admission.slo.enabled:
            tasks.append(asyncio.create_task(LoadPoller(state.registry, client, settings.load_interval,
                                                            admission.router_id).run()))
        state.kv_events.start()
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        state.kv_events.close()
        if state.tracing is not None:
            state.tracing.tracing.shutdown()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.router = state
    app.state.can_serve = state.selector.can_serve  # serve.py: when a router sharing its port may take connections
    if settings.api_key:
        app.middleware("http")(bearer_auth(settings.api_key))
    for routes in (membership, operations, openai):
        app.include_router(routes.router)
    return app


def _router_state(settings: RouterSettings, reader: PromptReader) -> RouterState:
    registry = Registry(settings.instance_expiry, settings.fail_threshold, settings.success_threshold)
    kv_index = KVIndex()
    kv_events = KVEventSubscriber(kv_index)
    registry.on_join = lambda i: kv_events.watch(i.url, [(s.endpoint, s.replay) for s in i.info.kv_events])
    registry.on_leave = lambda url: kv_events.watch(url, [])
    metrics = RouterMetrics(registry, kv_events)
    decider = (PrefillDecider(settings.max_local_prefill_length, settings.max_prefill_queue_tokens,
                              settings.local_prefill_decode_requests, kv_index)
               if settings.pd_policy == "conditional" else None)
    selector = Selector(registry, _policy(settings.prefill_policy, settings, kv_index),
                        _policy(settings.decode_policy, settings, kv_index), decider, metrics.count_decision)
    signatures = SignatureCheck((settings.cluster_secret or "").encode())
    state = RouterState(settings, registry, selector, metrics, signatures, reader, kv_events)
    slo, limits = admission_from_flags(settings.ttft_slo_ms, settings.tpot_slo_ms, settings.rate_limit)
    if slo.enabled or limits is not None:
        state.admission = RouterAdmission(slo, limits, AdmissionMetrics(metrics.prometheus, "pdserve_router"),
                                          registry, selector, settings.api_key, kv_index, settings.admitting_routers)
    if settings.otlp_traces_endpoint:
        state.tracing = _tracing(settings)
    return state


def _tracing(settings: RouterSettings) -> RouterTracing:
    from pdserve.tracing.setup import start_tracing

    tracing = start_tracing(settings.otlp_traces_endpoint, "pdserve-router", f"{settings.host}:{settings.port}")
    from pdserve.router.tracing import RouterTracing  # after: without the SDK, start_tracing says what to install

    return RouterTracing(tracing, settings.prefill_policy, settings.decode_policy)


def _policy(name: str, settings: RouterSettings, kv_index: KVIndex) -> Policy:
    return make_policy(name, overlap_weight=settings.kv_overlap_score_weight,
                       decode_weight=settings.kv_decode_load_weight, kv_index=kv_index)
