"""Registered instances, expiry of the silent ones, and round-robin choice of a P/D pair (or a mixed one)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, Field


class Registration(BaseModel):
    role: str = Field(pattern="^(mixed|prefill|decode)$")
    url: str = Field(min_length=1)  # the instance's HTTP address, e.g. http://10.0.0.5:8001
    model: str | None = None
    pd_comm: str | None = None  # prefill: host:port of its control plane
    transports: list[str] = []


@dataclass
class Instance:
    info: Registration
    last_seen: float = field(default_factory=time.monotonic)


class Registry:
    def __init__(self, expiry: float = 10.0) -> None:
        self.expiry = expiry
        self._instances: dict[str, Instance] = {}
        self._turn = itertools.count()

    def register(self, info: Registration) -> bool:
        """True when the instance is new (or came back)."""
        known = info.url in self._instances
        self._instances[info.url] = Instance(info)
        return not known

    def unregister(self, url: str) -> None:
        self._instances.pop(url, None)

    def live(self, role: str | None = None) -> list[Registration]:
        now = time.monotonic()
        for url in [u for u, i in self._instances.items() if now - i.last_seen > self.expiry]:
            del self._instances[url]
        return sorted((i.info for i in self._instances.values() if role is None or i.info.role == role),
                      key=lambda r: r.url)

    def ready(self) -> bool:
        return bool(self.live("mixed")) or (bool(self.live("prefill")) and bool(self.live("decode")))

    def pick(self) -> tuple[Registration, Registration | None] | None:
        """(prefill, decode) round robin; else (mixed, None); None when nothing can serve."""
        turn = next(self._turn)
        prefill, decode = self.live("prefill"), self.live("decode")
        if prefill and decode:
            return prefill[turn % len(prefill)], decode[turn % len(decode)]
        mixed = self.live("mixed")
        if mixed:
            return mixed[turn % len(mixed)], None
        return None

    def model_name(self) -> str | None:
        return next((i.model for i in self.live() if i.model), None)
