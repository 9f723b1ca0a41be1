"""The OpenAI-compatible HTTP server of one instance (FastAPI).

The engine runs in its own process; this process tokenizes, applies the chat template,
detokenizes incrementally, streams, and reports errors in the OpenAI format. The routes are modules
per concern (routes/openai.py, routes/tokens.py, routes/operations.py) over one `ServerState`; what
they do with a request is handling.py, their errors errors.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pdserve.api.data_parallel import DataParallelPrefix
from pdserve.api.errors import add_error_handlers
from pdserve.api.registration import register_forever
from pdserve.api.routes import lora, openai, operations, role, tokens
from pdserve.api.state import ServerState
from pdserve.http.auth import bearer_auth

log = logging.getLogger("pdserve.serve")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        tasks = [asyncio.create_task(_refresh_metrics(state)), asyncio.create_task(_exit_when_engine_dies(state))]
        tasks += [asyncio.create_task(register_forever(url, instance)) for url in state.router_urls
                  for instance in state.instances]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await state.engine.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.server = state
    if state.api_key:
        app.middleware("http")(bearer_auth(state.api_key))
    if state.data_parallel_size > 1:  # outermost: /dp/R/... is rank R's (the router's address of it)
        app.add_middleware(DataParallelPrefix, ranks=state.data_parallel_size)
    add_error_handlers(app)
    for routes in (operations, openai, tokens, lora, role):
        app.include_router(routes.router)
    return app


async def _exit_when_engine_dies(state: ServerState, grace: float = 0.5) -> None:
    """An instance without its engine (or the engine's worker or cache service) cannot serve again: it
    stops, exit code 1, so that its supervisor (`pdserve launch`, systemd, Kubernetes) starts it afresh,
    as vLLM's server does. /health says 503 meanwhile; requests in flight get their errors first."""
    await state.engine.dead.wait()
    log.error("the engine died (%s): this instance stops (exit code 1) for its supervisor to restart it",
              state.engine.error)
    state.exit_code = 1
    await asyncio.sleep(grace)
    if state.request_shutdown is not None:
        state.request_shutdown()


async def _refresh_metrics(state: ServerState, period: float = 1.0) -> None:
    """The --metrics-port exporter (a thread) only reads the registry: keep its engine gauges current."""
    while True:
        await asyncio.sleep(period)
        await state.metrics.refresh(state.engine)
