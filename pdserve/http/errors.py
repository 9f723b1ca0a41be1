"""The OpenAI error body: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import json
import logging
from typing import Any

# The "type" of every error of the PD path (a transfer failed, a peer gave up or is unreachable), set
# by the instances and by the router alike: the router tells a PD failure from others by it.
PD_ERROR = "pd_error"


def error_body(message: str, status: int, err_type: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def read_error(body: bytes | str | dict[str, Any]) -> dict[str, Any] | None:
    """The `error` object of an OpenAI error body, or None when the body is not one."""
    try:
        error = (body if isinstance(body, dict) else json.loads(body)).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) else None


REQUEST_ID_HEADER = "x-request-id"  # the client's id for a request, else the router's; passed on to instances


def explain_error(log: logging.Logger, counter: Any, method: str, path: str, request_id: str | None, status: int,
                  body: bytes | dict[str, Any]) -> None:
    """Log an error answer at INFO (what was asked, its id, status, type and message) and count it by type:
    the log alone says what happened to a request that got no answer."""
    error = read_error(body) or {}
    reason = str(error.get("type") or f"http_{status}")
    counter.labels(reason).inc()
    verb = "refused" if status < 500 else "failed"
    log.info("%s %s %s%s: %d %s: %s", verb, method, path, f" (request {request_id})" if request_id else "", status,
             reason, str(error.get("message") or "")[:500])
