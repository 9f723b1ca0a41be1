"""Passing one instance's answer through: an error answer as it is (a Retry when another route may do better),
a whole answer once it is all in, a stream once its first event shows it did not fail."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from fastapi.responses import Response

from pdserve.http.errors import PD_ERROR, error_body
from pdserve.router.exchange import BROKEN, Exchange, drain, pump
from pdserve.router.outcome import Leg, Opened, Outcome, Retry, error_response
from pdserve.router.sse import server_error, take_token_ids, whole_events

RETRYABLE_STATUS = (429, 500, 502, 503, 504)


async def relay(ex: Exchange, upstream: aiohttp.ClientResponse, stream: bool, queue: asyncio.Queue | None = None,
                reader: asyncio.Task | None = None) -> Outcome:
    """Pass `upstream` through (its body from `queue` when a pump already reads it). Owns `ex` from here."""
    if upstream.status != 200:
        try:
            answer = await read_error_answer(upstream, ex)
        finally:
            ex.close()
        return Retry(ex.instance, answer) if upstream.status in RETRYABLE_STATUS else answer
    if queue is None or reader is None:
        queue = asyncio.Queue()
        reader = asyncio.create_task(pump(ex.chunks(upstream), queue))
    leg = Leg(ex, upstream, reader, queue)
    return await (_first_event(leg, queue) if stream else _whole(leg, queue))


async def _whole(leg: Leg, queue: asyncio.Queue) -> Response | Retry:
    try:  # the finally below also runs when the client hangs up (cancellation)
        content = b"".join([chunk async for chunk in drain(queue)])
    except BROKEN as e:
        leg.ex.broken(e)
        return Retry(leg.ex.instance, error_response(
            f"PD error: the instance {leg.ex.instance.url} failed mid-answer: {e}", 502, PD_ERROR))
    finally:
        leg.close()
    return Response(content, status_code=200, media_type="application/json")


async def _first_event(leg: Leg, queue: asyncio.Queue) -> Opened | Retry:
    """The first event decides: a failure before it can still be retried elsewhere."""
    rest = whole_events(queue)
    try:
        first = await anext(rest, b"")
    except BaseException as e:
        leg.close()
        if not isinstance(e, BROKEN):
            raise
        leg.ex.broken(e)
        return Retry(leg.ex.instance, error_response(f"PD error: the instance {leg.ex.instance.url} failed: {e}",
                                                     502, PD_ERROR))
    if (message := server_error(take_token_ids(first)[0])) is not None:  # e.g. D lost its P mid-transfer
        leg.close()
        return Retry(None, error_response(message, 502, PD_ERROR))
    leg.ex.prefilled()
    return Opened(leg, first, rest)


async def read_error_answer(upstream: aiohttp.ClientResponse, ex: Exchange) -> Response:
    """An instance's error answer, passed on as it is."""
    try:
        content = await ex.guard(upstream.read())
    except BROKEN as e:
        content = json.dumps(error_body(f"the instance failed while answering: {e}", 502)).encode()
    finally:
        upstream.close()
    return Response(content, status_code=upstream.status, media_type="application/json")
