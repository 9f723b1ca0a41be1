"""The router's own health (whether it can route a request now), its Prometheus metrics, and /cluster."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.router.cluster import cluster_view
from pdserve.router.outcome import error_response
from pdserve.router.state import RouterDep

router = APIRouter()


@router.get("/health")
async def health(state: RouterDep) -> Response:
    if state.selector.can_serve():
        return Response(status_code=200)
    return error_response(state.selector.why_not(), 503)


@router.get("/cluster")
async def cluster(state: RouterDep) -> dict:
    """The deployment as this router sees it, every member with its own /status (router/cluster.py)."""
    me = {"url": f"http://{state.settings.host}:{state.settings.port}", "can_serve": state.selector.can_serve(),
          "last_minute": state.recent.summary(), "prefill_policy": state.settings.prefill_policy,
          "decode_policy": state.settings.decode_policy, "pd_policy": state.settings.pd_policy}
    return await cluster_view(state.forwarder.client, state.registry.all(), me)


@router.get("/metrics")
async def prometheus(state: RouterDep) -> Response:
    return Response(generate_latest(state.metrics.prometheus), media_type=CONTENT_TYPE_LATEST)
