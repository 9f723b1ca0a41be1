"""The OpenAI error body: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import Any


def error_body(message: str, status: int, err_type: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}
