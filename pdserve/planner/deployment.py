"""What the planner reads of a deployment each interval: who is registered (a router's /registered), the
instances' and routers' /metrics, and once per process whether an instance may change role (GET /role)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

log = logging.getLogger("pdserve.planner")


@dataclass(frozen=True)
class Member:
    url: str
    role: str
    pid: int | None
    metrics_url: str | None
    in_flight: int
    in_pool: bool  # healthy and not draining


@dataclass(frozen=True)
class DeploymentView:
    members: list[Member]
    router_metrics: list[str]
    instance_metrics: dict[str, tuple[str, str]]  # url -> (role, /metrics text)


class Deployment:
    def __init__(self, client: httpx.AsyncClient, routers: list[str]) -> None:
        self.client, self.routers = client, [r.rstrip("/") for r in routers]
        self._switchable: dict[tuple[str, int | None], bool] = {}

    async def read(self) -> DeploymentView:
        members = await self._members()
        router_texts = await asyncio.gather(*(self._text(f"{r}/metrics") for r in self.routers))
        texts = await asyncio.gather(*(self._text(m.metrics_url) for m in members if m.metrics_url))
        with_metrics = [m for m in members if m.metrics_url]
        return DeploymentView(members, [t for t in router_texts if t],
                              {m.url: (m.role, t) for m, t in zip(with_metrics, texts, strict=True) if t})

    async def switchable(self, member: Member) -> bool:
        key = (member.url, member.pid)
        if key not in self._switchable:
            try:
                r = await self.client.get(f"{member.url}/role")
                self._switchable[key] = r.status_code == 200 and bool(r.json().get("switchable"))
            except (httpx.HTTPError, ValueError) as e:
                log.warning("could not ask %s whether it may change role: %s", member.url, e)
                return False
        return self._switchable[key]

    async def _members(self) -> list[Member]:
        errors = []
        for router in self.routers * 2:  # each twice: a kept-alive connection the router closed fails once
            try:
                r = await self.client.get(f"{router}/registered")
                r.raise_for_status()
                return [_member(i) for i in r.json()["instances"]]
            except (httpx.HTTPError, ValueError, KeyError) as e:
                errors.append(f"{router}: {e}")
        log.warning("could not read who is registered: %s", "; ".join(errors))
        return []

    async def _text(self, url: str) -> str:
        try:
            r = await self.client.get(url)
            r.raise_for_status()
            return r.text
        except httpx.HTTPError as e:
            log.warning("could not read %s: %s", url, e)
            return ""


def _member(info: dict) -> Member:
    port, host = info.get("metrics_port"), info.get("host")
    return Member(info["url"], info["role"], info.get("pid"),
                  f"http://{host}:{port}/metrics" if port and host else None,
                  int(info.get("in_flight_requests", 0)),
                  bool(info.get("healthy")) and not info.get("draining", False))
