"""Instances join (`/register`, a signed heartbeat) and leave (`/unregister`); who is in the pool."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

from pdserve.config.roles import Role
from pdserve.http.wire import Registration
from pdserve.router.outcome import error_response
from pdserve.router.state import RouterDep, RouterState
from pdserve.utils.cluster_auth import SIGNATURE_HEADER, AuthError

log = logging.getLogger("pdserve.router")

router = APIRouter()


class Unregistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str


async def _signed_body(raw: Request, state: RouterState) -> bytes | JSONResponse:
    """The body, if the cluster secret signs it; else the 403 to answer (or nothing, to one that hung up)."""
    try:
        body = await raw.body()
    except ClientDisconnect:  # an instance stopped mid-heartbeat: nobody is left to answer
        log.info("%s from %s: the instance hung up before its body arrived", raw.url.path,
                 raw.client.host if raw.client else "?")
        return Response(status_code=400)
    try:
        state.signatures.verify(raw.url.path, body, raw.headers.get(SIGNATURE_HEADER))
    except AuthError as e:
        client = raw.client.host if raw.client else "?"
        log.warning("refused %s from %s: %s", raw.url.path, client, e)
        state.metrics.refused.labels("registration").inc()
        return error_response(f"registration refused: {e}", 403, "permission_error")
    return body


@router.post("/register")
async def register(raw: Request, state: RouterDep) -> Response:
    body = await _signed_body(raw, state)
    if isinstance(body, Response):
        return body
    try:
        info = Registration.model_validate_json(body)
    except ValidationError as e:
        return error_response(f"bad registration: {e.errors()[0].get('msg')}", 400, "invalid_request_error")
    instance, probe = state.registry.register(info)
    if probe:
        state.checker.probe_soon(instance)
    return JSONResponse({"status": "ok", "healthy": instance.healthy})


@router.post("/unregister")
async def unregister(raw: Request, state: RouterDep) -> Response:
    body = await _signed_body(raw, state)
    if isinstance(body, Response):
        return body
    try:
        state.registry.unregister(Unregistration.model_validate_json(body).url)
    except ValidationError:
        return error_response("bad unregistration: a url is needed", 400, "invalid_request_error")
    return JSONResponse({"status": "ok"})


@router.get("/registered")
@router.get("/instances")  # the first router's name for it
async def registered(state: RouterDep) -> dict:
    return {"instances": [i.as_dict() for i in state.registry.all()]}


@router.get("/registered_number")
async def registered_number(state: RouterDep) -> dict:
    counts = {role.value: 0 for role in (Role.PREFILL, Role.DECODE, Role.MIXED)}
    healthy = dict(counts)
    for i in state.registry.all():
        counts[i.role] += 1
        healthy[i.role] += i.healthy
    return {**counts, "healthy": healthy}
