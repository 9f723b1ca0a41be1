"""The OpenAI error body: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import Any

# The "type" of every error of the PD path (a transfer failed, a peer gave up or is unreachable), set
# by the instances and by the router alike: the router tells a PD failure from others by it.
PD_ERROR = "pd_error"


def error_body(message: str, status: int, err_type: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}
