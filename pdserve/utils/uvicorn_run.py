"""Run a uvicorn server and say (once) when it listens; fail clearly when it cannot."""

from __future__ import annotations

import asyncio

import uvicorn


async def serve_and_announce(server: uvicorn.Server, announcement: str) -> None:
    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        if server.started:
            print(announcement, flush=True)

    task = asyncio.create_task(announce())
    await server.serve()
    task.cancel()
    if not server.started:
        cfg = server.config
        raise OSError(f"could not listen on {cfg.host}:{cfg.port} (is the port in use?)")
