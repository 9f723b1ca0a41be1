"""`--api-key`: /v1 requests must carry `Authorization: Bearer KEY` (the API server and the router)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.http.errors import error_body


def bearer_auth(api_key: str) -> Callable[[Request, Callable], Awaitable[Response]]:
    """HTTP middleware: /v1 requests without `Authorization: Bearer <api_key>` get an OpenAI 401."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request, call_next: Callable) -> Response:
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                message = "invalid API key" if given else "missing API key: send 'Authorization: Bearer <key>'"
                return JSONResponse(error_body(message, 401, "authentication_error"), status_code=401)
        return await call_next(request)

    return check
