"""Changing an instance's role in place (POST /role, --enable-role-switch): drain, switch, announce.

The instance first tells its routers it is draining (a registration with `draining`: they route nothing new to
it), waits until no request is in flight here or held in the engine, then asks the engine to change role (the
weights, the KV cache and its prefix index stay) and registers with the new role. A drain that does not finish
within its timeout, or an engine that refuses, puts the instance back as it was: it announces its old role and
serves on. Every change and every failure is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.api.registration import post_signed
from pdserve.engine.engine_client import EngineError

if TYPE_CHECKING:
    from pdserve.api.state import ServerState

log = logging.getLogger("pdserve.role")

DRAIN_POLL_S = 0.05


class RoleChangeFailed(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RoleChanger:
    def __init__(self, state: ServerState, role: str) -> None:
        self.state = state
        self.role = role
        self.busy = False

    async def change(self, role: str, drain_timeout: float) -> dict:
        if self.busy:
            raise RoleChangeFailed("a role change is already under way", 409)
        if role == self.role:
            return {"role": role, "changed": False, "seconds": 0.0}
        self.busy = True
        started = time.monotonic()
        try:
            await self._announce(draining=True)
            await self._drain(drain_timeout)
            result = await self._switch(role)
        except RoleChangeFailed as e:
            log.warning("role change %s -> %s failed, the instance stays %s: %s", self.role, role, self.role, e)
            self.state.metrics.role_change(self.role, role, "failed", time.monotonic() - started)
            await self._announce(draining=False)
            raise
        finally:
            self.busy = False
        seconds = time.monotonic() - started
        log.info("role changed %s -> %s in %.2f s (drained, switched, announced)", self.role, role, seconds)
        self.state.metrics.role_change(self.role, role, "ok", seconds)
        self.role = role
        for instance in self.state.instances:
            instance["role"], instance["pd_sides"] = role, result["sides"]
        await self._announce(draining=False)
        return {"role": role, "changed": True, "seconds": round(seconds, 3)}

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := await self._in_flight()) > 0:
            if time.monotonic() >= deadline:
                raise RoleChangeFailed(f"{left} requests were still in flight after the {timeout:g} s drain "
                                       "timeout", 409)
            await asyncio.sleep(DRAIN_POLL_S)

    async def _in_flight(self) -> int:
        stats = await self.state.engine.call("stats")
        return self.state.in_flight + stats.running + stats.waiting + stats.preallocated

    async def _switch(self, role: str) -> dict:
        """The engine refuses while it holds a request or a transfer; one that came in since the drain is
        waited for (a router may have chosen this instance just before it heard of the drain)."""
        while True:
            try:
                return await self.state.engine.call("set_role", args={"role": role}, timeout=30)
            except EngineError as e:
                if not str(e).startswith("not drained"):
                    raise RoleChangeFailed(f"the engine refused: {e}", 500) from None
            await self._drain(10.0)

    async def _announce(self, draining: bool) -> None:
        """Registrations now, not at the next heartbeat: the routers stop (or resume) choosing it at once."""
        for instance in self.state.instances:
            instance["draining"] = draining
        await asyncio.gather(*(self._register(url, instance) for url in self.state.router_urls
                               for instance in self.state.instances))

    @staticmethod
    async def _register(router_url: str, instance: dict) -> None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                (await post_signed(client, router_url.rstrip("/"), "/register", instance)).raise_for_status()
        except httpx.HTTPError as e:
            log.warning("could not tell the router at %s of the role change: %s (the next heartbeat will)",
                        router_url, e)
