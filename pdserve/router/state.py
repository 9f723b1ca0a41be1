"""What the router's routes share, kept at `app.state.router` and read through `RouterDep`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from pdserve.kv_events.subscriber import KVEventSubscriber
from pdserve.router.admission import RouterAdmission
from pdserve.router.cluster import RecentAnswers
from pdserve.router.forward import Forwarder
from pdserve.router.health import HealthChecker
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prompt import PromptReader
from pdserve.router.registry import Registry
from pdserve.router.selector import Selector
from pdserve.router.settings import RouterSettings
from pdserve.utils.cluster_auth import SignatureCheck

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from pdserve.router.tracing import RouterTracing


@dataclass
class RouterState:
    settings: RouterSettings
    registry: Registry
    selector: Selector
    metrics: RouterMetrics
    signatures: SignatureCheck
    reader: PromptReader
    kv_events: KVEventSubscriber
    admission: RouterAdmission | None = None  # --ttft-slo-ms, --tpot-slo-ms, --rate-limit
    tracing: RouterTracing | None = None  # --otlp-traces-endpoint
    recent: RecentAnswers = field(default_factory=RecentAnswers)  # the last minute, for GET /cluster
    # Made in the lifespan, on the running event loop (they share its HTTP client session):
    forwarder: Forwarder = field(init=False)
    checker: HealthChecker = field(init=False)


async def router_state(request: Request) -> RouterState:
    """The router's state (async: FastAPI would run a plain function in its thread pool)."""
    return request.app.state.router


RouterDep = Annotated[RouterState, Depends(router_state)]
