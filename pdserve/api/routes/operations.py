"""What operators and the router ask an instance: /health, /metrics, /v1/models, and the weights' release
and reload (/clear_load_weight, /update_model_weight)."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pdserve.api.data_parallel import ROUTED_RANK
from pdserve.api.state import APIError, ServerDep
from pdserve.api.status import instance_status
from pdserve.engine.engine_client import EngineError
from pdserve.engine.messages import ClearWeights, LoadWeights
from pdserve.http.errors import error_body

router = APIRouter()


@router.get("/health")
async def health(state: ServerDep) -> Response:
    if not state.engine.healthy:
        return JSONResponse(error_body(state.engine.error or "engine is down", 503, "service_unavailable"),
                            status_code=503)
    if state.weights_cleared:
        return JSONResponse(error_body("the model weights are cleared", 503, "service_unavailable"),
                            status_code=503)
    return Response(status_code=200)


@router.get("/load")
async def load(state: ServerDep, router: str | None = None) -> Response:
    """The engine's latest load report (JSON; null before its first), for routers that admit by SLO, with what
    this server handed the engine since and, for `router`, the highest of its sequence numbers taken. On a
    data-parallel server, /dp/R/load is rank R's own report."""
    reports = state.engine.load_reports()
    if state.engine.data_parallel:
        rank = ROUTED_RANK.get()
        report = reports[rank] if rank is not None and rank < len(reports) else None
    elif (report := reports[0]) is not None:
        report = state.taken.fold_into(report, state.acked.get(router, 0) if router else -1)
    return Response(msgspec.json.encode(report), media_type="application/json")


@router.api_route("/clear_load_weight", methods=["GET", "POST"])
async def clear_load_weight(state: ServerDep) -> dict:
    """Free the weights and the KV cache (mixed role); requests get 503 until they are loaded again."""
    state.weights_cleared = True
    try:
        result = await state.engine.call(ClearWeights(), timeout=120)
    except EngineError as e:
        raise APIError(str(e), 500, "internal_server_error") from None
    return {"status": "cleared", **result}


@router.api_route("/update_model_weight", methods=["GET", "POST"])
async def update_model_weight(state: ServerDep) -> dict:
    """Load the weights from disk again and recreate the KV cache."""
    try:
        await state.engine.call(LoadWeights(), timeout=600)
    except EngineError as e:
        raise APIError(str(e), 500, "internal_server_error") from None
    state.weights_cleared = False
    return {"status": "loaded"}


@router.get("/status")
async def status(state: ServerDep) -> dict:
    """This instance as live views show it (`pdserve top`, a router's /cluster)."""
    ranks = [stats for _, stats in await state.engine.stats_by_rank()]
    return instance_status(state.current_role, state.in_flight, ranks, state.recent)


@router.get("/v1/models")
async def models(state: ServerDep) -> dict:
    base = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": state.max_model_len}
    return {"object": "list", "data": [base, *(state.lora.model_cards(state.model_name) if state.lora else [])]}


@router.get("/metrics")
async def metrics(state: ServerDep) -> Response:
    return await state.metrics.render(state.engine)
