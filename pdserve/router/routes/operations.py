"""The router's own health (whether it can route a request now) and its Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.router.forward import error_response
from pdserve.router.state import RouterDep

router = APIRouter()


@router.get("/health")
async def health(state: RouterDep) -> Response:
    if state.selector.can_serve():
        return Response(status_code=200)
    return error_response(state.selector.why_not(), 503)


@router.get("/metrics")
async def prometheus(state: RouterDep) -> Response:
    return Response(generate_latest(state.metrics.prometheus), media_type=CONTENT_TYPE_LATEST)
