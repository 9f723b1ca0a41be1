"""Changing an instance's role in place (POST /role, --enable-role-switch): switch, announce; drain first if asked.

The engine changes role at once: the weights, the KV cache and its prefix index stay, and what is in flight goes on
(a transfer ends on the connector that began it, a stream decodes to its end), so a change leaves no hole in the
deployment's capacity. The new role goes to the routers at once, not at the next heartbeat. With a drain timeout,
the instance first tells its routers it is draining (they route nothing new to it) and waits until nothing is in
flight here or in the engine; a drain that does not finish in time, or an engine that refuses, puts it back as it
was: it announces its old role and serves on. Every change and every failure is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from pdserve.engine.engine_client import EngineError
from pdserve.engine.messages import GetStats, SetRole
from pdserve.http.members import post_signed

if TYPE_CHECKING:
    from pdserve.api.async_engine import AsyncEngine
    from pdserve.api.metrics import ServerMetrics

log = logging.getLogger("pdserve.role")

DRAIN_POLL_S = 0.05


class RoleChangeFailed(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RoleChanger:
    def __init__(self, role: str, engine: AsyncEngine, metrics: ServerMetrics, in_flight: Callable[[], int],
                 instances: list[dict], router_urls: list[str]) -> None:
        """`in_flight`: the requests this server is answering; `instances`: its registrations (a change edits
        them: the heartbeats carry the new role)."""
        self.role, self.engine, self.metrics, self.in_flight = role, engine, metrics, in_flight
        self.instances, self.router_urls = instances, router_urls
        self.busy = False

    async def change(self, role: str, drain_timeout: float) -> dict:
        if self.busy:
            raise RoleChangeFailed("a role change is already under way", 409)
        if role == self.role:
            return {"role": role, "changed": False, "seconds": 0.0}
        self.busy = True
        started = time.monotonic()
        try:
            if drain_timeout > 0:
                await self._announce(draining=True)
                await self._drain(drain_timeout)
            result = await self._switch(role)
        except RoleChangeFailed as e:
            log.warning("role change %s -> %s failed, the instance stays %s: %s", self.role, role, self.role, e)
            self.metrics.role_change(self.role, role, "failed", time.monotonic() - started)
            await self._announce(draining=False)
            raise
        finally:
            self.busy = False
        seconds = time.monotonic() - started
        log.info("role changed %s -> %s in %.2f s%s", self.role, role, seconds,
                 " (drained first)" if drain_timeout > 0 else "")
        self.metrics.role_change(self.role, role, "ok", seconds)
        self.role = role
        for instance in self.instances:
            instance["role"], instance["pd_sides"] = role, result["sides"]
        await self._announce(draining=False)
        return {"role": role, "changed": True, "seconds": round(seconds, 3)}

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := await self._in_flight(max(deadline - time.monotonic(), DRAIN_POLL_S))) != 0:
            if time.monotonic() >= deadline:
                what = "the engine was inside a step" if left is None else f"{left} requests were still in flight"
                raise RoleChangeFailed(f"{what} after the {timeout:g} s drain timeout", 409)
            await asyncio.sleep(DRAIN_POLL_S)

    async def _in_flight(self, timeout: float) -> int | None:
        """The requests this server answers, or the engine holds if more (a PD side's is the engine's alone);
        None when the engine could not answer within `timeout` (a step longer than that)."""
        try:
            stats = await self.engine.call(GetStats(), timeout=timeout)
        except TimeoutError:
            return None
        return max(self.in_flight(), stats.running + stats.waiting + stats.preallocated)

    async def _switch(self, role: str) -> dict:
        try:
            return await self.engine.call(SetRole(role), timeout=30)
        except EngineError as e:
            raise RoleChangeFailed(f"the engine refused: {e}", 500) from None
        except TimeoutError:
            raise RoleChangeFailed("the engine did not answer the change within 30 s", 503) from None

    async def _announce(self, draining: bool) -> None:
        """Registrations now, not at the next heartbeat: the routers stop (or resume) choosing it at once."""
        for instance in self.instances:
            instance["draining"] = draining
        await asyncio.gather(*(self._register(url, instance) for url in self.router_urls
                               for instance in self.instances))

    @staticmethod
    async def _register(router_url: str, instance: dict) -> None:
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                (await post_signed(client, router_url.rstrip("/"), "/register", instance)).raise_for_status()
        except httpx.HTTPError as e:
            log.warning("could not tell the router at %s of the role change: %s (the next heartbeat will)",
                        router_url, e)
