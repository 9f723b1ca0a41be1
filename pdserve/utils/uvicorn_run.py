"""Run a uvicorn server and say (once) when it listens; fail clearly when it cannot."""

from __future__ import annotations

import asyncio

import uvicorn

# On SIGTERM uvicorn waits for open requests to end; without a bound, a connection that never ends
# held a stopping instance forever (twice in CI runs: all of its processes asleep 20 s after SIGTERM).
# Past this, what still runs is cancelled and the stop goes on.
GRACEFUL_SHUTDOWN_S = 5


def server_config(app: object, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


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
