"""Server-sent events as the router relays them: whole events only, so that a stream cut mid-event
never shows its client half an event, and the one comment line instances add for the router."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp

from pdserve.http.errors import read_error
from pdserve.http.wire import TOKENS_COMMENT
from pdserve.router.exchange import drain

DONE = b"data: [DONE]\n\n"


async def whole_events(queue: asyncio.Queue) -> AsyncIterator[bytes]:
    """The events in a relay queue (exchange.pump), each with its blank line; failures raise. A stream that
    ends inside an event failed there: the partial event is not the client's (SSE clients drop it too, or choke
    on it), and the failure lets the stream resume elsewhere."""
    buffered = b""
    async for chunk in drain(queue):
        buffered += chunk
        end = buffered.rfind(b"\n\n")
        if end == -1:
            continue
        complete, buffered = buffered[:end + 2], buffered[end + 2:]
        start = 0
        while (cut := complete.find(b"\n\n", start)) != -1:
            yield complete[start:cut + 2]
            start = cut + 2
    if buffered.strip():
        raise aiohttp.ClientPayloadError(f"the stream ended inside an event: {buffered[:80]!r}")


def take_token_ids(event: bytes) -> tuple[bytes, list[int] | None]:
    """The event without its token comment, and the token ids the comment named (None: no comment)."""
    if not event.startswith(TOKENS_COMMENT):
        return event, None
    line_end = event.find(b"\n")
    ids = event[len(TOKENS_COMMENT):line_end].split()
    return event[line_end + 1:], [int(t) for t in ids]


def server_error(event: bytes) -> str | None:
    """The message of an error event the instance sent for its own failure (5xx), else None.
    A 4xx error event (the request's fault) is relayed as it is."""
    if not event.startswith(b'data: {"error"') or (error := read_error(event[len(b"data: "):])) is None:
        return None
    try:
        code = int(error.get("code") or 500)
    except (ValueError, TypeError):
        return None
    return str(error.get("message", "")) if code >= 500 else None


def error_event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()
