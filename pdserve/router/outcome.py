"""What one try of a route ends in: an answer for the client, a stream whose first event is in hand (Opened), or
a Retry on another route. A leg (one exchange with one instance) is closed one way, `Leg.close`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi.responses import JSONResponse, Response

from pdserve.http.errors import error_body, read_error
from pdserve.router.exchange import Exchange
from pdserve.router.registry import Instance


def error_response(message: str, status: int, err_type: str = "service_unavailable") -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


def response_message(response: Response) -> str:
    """An error answer's message (OpenAI's body), else its status."""
    error = read_error(bytes(response.body))
    return str(error["message"]) if error is not None and "message" in error else f"HTTP {response.status_code}"


@dataclass
class Retry:
    """This route failed before the client saw anything; try another without `failed` (None: the
    instance answered, with an error event of its own, and stays a candidate)."""

    failed: Instance | None
    response: Response


@dataclass
class Leg:
    """One exchange with one instance: its response and the task pumping its body."""

    ex: Exchange
    upstream: aiohttp.ClientResponse
    reader: asyncio.Task | None = None
    queue: asyncio.Queue | None = None  # where `reader` puts the body's chunks

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.upstream.close()
        self.ex.close()


@dataclass
class Opened:
    """A streamed answer whose first event is in hand; `close` ends the exchange."""

    leg: Leg
    first: bytes
    rest: AsyncIterator[bytes]
    span: Any = None  # router/tracing.RouteSpan of its route, when traced: ends with the exchange

    @property
    def ex(self) -> Exchange:
        return self.leg.ex

    async def events(self) -> AsyncIterator[bytes]:
        yield self.first
        async for event in self.rest:
            yield event

    def close(self, error: str | None = None) -> None:
        self.leg.close()
        if self.span is None:
            return
        if error:
            self.span.failed(error)
        else:
            self.span.answered(200)
        self.span = None


Outcome = Response | Opened | Retry


def settle(span: Any, outcome: Outcome) -> None:
    """A traced route's span: a stream's goes on with it; any other ends with its answer."""
    if isinstance(outcome, Opened):
        outcome.span = span
    elif isinstance(outcome, Retry):
        span.failed(response_message(outcome.response))
    else:
        span.answered(outcome.status_code)
