"""Active health checks: GET /health on every instance every `interval` seconds (and at once on news)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdserve.router.registry import Instance, Registry

log = logging.getLogger("pdserve.router")


class HealthChecker:
    def __init__(self, registry: Registry, client: aiohttp.ClientSession, interval: float = 2.0,
                 timeout: float = 2.0) -> None:
        self.registry, self.client = registry, client
        self.interval, self.timeout = interval, timeout
        self._probing: set[int] = set()  # id() of instances being probed (a restart is a new one)
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        while True:
            try:
                self.registry.expire()
                await asyncio.gather(*(self.probe(i) for i in self.registry.all()))
            except Exception:  # a bug here must not end health checking for good
                log.exception("health check round failed")
            await asyncio.sleep(self.interval)

    def probe_soon(self, instance: Instance) -> None:
        task = asyncio.create_task(self.probe(instance))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def probe(self, instance: Instance) -> None:
        if id(instance) in self._probing:
            return
        self._probing.add(id(instance))
        try:
            async with self.client.get(f"{instance.url}/health",
                                       timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                status, text = r.status, (await r.read())[:200].decode(errors="replace")
            if status == 200:
                self.registry.probe_succeeded(instance)
            else:
                self.registry.probe_failed(instance, f"/health answered {status}: {text}")
        except (TimeoutError, aiohttp.ClientError) as e:
            self.registry.probe_failed(instance, f"/health failed: {type(e).__name__}: {e}")
        finally:
            self._probing.discard(id(instance))
