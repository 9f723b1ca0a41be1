"""GET /role: what this instance is; POST /role: change it in place (--enable-role-switch; the planner's lever).

A change is asked with a body signed by the cluster secret, as a registration is: only a member of the
deployment may reshape it."""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.api.role_change import RoleChangeFailed
from pdserve.api.state import APIError, ServerDep
from pdserve.utils.cluster_auth import SIGNATURE_HEADER, AuthError

log = logging.getLogger("pdserve.role")

router = APIRouter()


class RoleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["mixed", "prefill", "decode"]
    # seconds to wait for the requests in flight before the change (0: change at once, they go on under it)
    drain_timeout: float = Field(0.0, ge=0, le=3600)


@router.get("/role")
async def role(state: ServerDep) -> dict:
    changer = state.role_changer
    return {"role": changer.role if changer else state.role, "switchable": changer is not None,
            "changing": bool(changer and changer.busy)}


@router.post("/role")
async def change_role(raw: Request, state: ServerDep) -> dict:
    body = await raw.body()
    try:
        state.signatures.verify(raw.url.path, body, raw.headers.get(SIGNATURE_HEADER))
    except AuthError as e:
        log.warning("refused a role change from %s: %s", raw.client.host if raw.client else "?", e)
        raise APIError(f"role change refused: {e}", 403, "permission_error") from None
    try:
        asked = RoleRequest.model_validate_json(body)
    except ValidationError as e:
        error = e.errors()[0]
        raise APIError(f"bad role change: {error.get('msg')}", 400, param=".".join(map(str, error["loc"]))) \
            from None
    if state.role_changer is None:
        raise APIError("this instance cannot change role: start it with --enable-role-switch", 400, param="role")
    try:
        return await state.role_changer.change(asked.role, asked.drain_timeout)
    except RoleChangeFailed as e:
        raise APIError(f"role change failed, the instance stays {state.role_changer.role}: {e}", e.status,
                       "conflict" if e.status == 409 else "internal_server_error") from None
