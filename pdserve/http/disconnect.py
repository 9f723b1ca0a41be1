"""Stop work nobody waits for: a non-streamed request whose client went away is cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it


async def until_disconnect(raw: Request, work: Any, poll: float = 0.5) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts what it started)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                return Response(status_code=CLIENT_CLOSED)
    except asyncio.CancelledError:
        task.cancel()
        raise
