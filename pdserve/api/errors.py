"""Every error the API server answers is in the OpenAI format: its own (APIError), a request the protocol
models refuse, and Starlette's (404, 405)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.state import APIError
from pdserve.http.errors import REQUEST_ID_HEADER, error_body, explain_error

log = logging.getLogger("pdserve.serve")


def answered(request: Request, response: JSONResponse) -> JSONResponse:
    """Every error answer is logged with its reason and counted (pdserve_requests_failed_total{reason})."""
    state = getattr(request.app.state, "server", None)
    if state is not None:
        if response.status_code == 429:
            state.recent.refused.add()
        explain_error(log, state.metrics.failed, request.method, request.url.path,
                      request.headers.get(REQUEST_ID_HEADER), response.status_code, response.body)
    return response


async def api_error(request: Request, e: APIError) -> JSONResponse:
    return answered(request, JSONResponse(error_body(str(e), e.status, e.err_type, e.param), status_code=e.status,
                                          headers=e.headers))


async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return answered(request, _validation_answer(e))


def _validation_answer(e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        message = f"the request body is not valid JSON: {reason} (at character {first['loc'][-1]})"
        return JSONResponse(error_body(message, 400), status_code=400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "refused_field":  # a field this server does not implement (protocol.REFUSED)
        field = (first.get("ctx") or {}).get("field")
        return JSONResponse(error_body(first["msg"], 400, param=field), status_code=400)
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    message = f"{'.'.join(loc) or 'body'}: {msg}"
    return JSONResponse(error_body(message, 400, param=".".join(loc) or None), status_code=400)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return answered(request, JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code))


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
