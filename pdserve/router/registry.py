"""The router's view of its instances: who they are, whether they are healthy, what load they carry.

Instances join by heartbeat (`POST /register`, every few seconds) or from a static list, and are
probed (`health.py`). An instance leaves the pool when it misses `fail_threshold` probes in a row
(or at once when a request finds it unreachable); every request in flight on it is told at that
moment, so none waits out a timeout. It comes back after `success_threshold` good probes, and a
restarted process (a new pid at the same address) joins on its first good probe. A registered
instance that stops heartbeating is forgotten after `expiry` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve.admission.load import LoadReport
from pdserve.admission.sent import SentSince
from pdserve.config.roles import Role
from pdserve.http.wire import Registration

log = logging.getLogger("pdserve.router")


class InstanceLost(Exception):
    """The instance a request was on left the pool (failed health checks, unreachable, expired)."""


@dataclass(eq=False)
class Instance:
    info: Registration
    static: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    healthy: bool = False
    fails: int = 0  # consecutive failed probes
    successes: int = 0  # consecutive good probes
    ever_healthy: bool = False
    in_flight_requests: int = 0
    in_flight_tokens: int = 0  # prompt tokens of the requests in flight
    in_flight_prefill_tokens: int = 0  # ... of those not yet past their first token, less what they found cached
    served: int = 0  # requests sent here
    failed: int = 0  # requests that failed here
    restarts: int = 0  # new pids seen at this url since the router started
    watchers: set[Callable[[str], None]] = field(default_factory=set)  # told when the instance is lost
    load: LoadReport | None = None  # its latest /load, timed by this router's clock (admission by SLO)
    sent: SentSince = field(default_factory=SentSince)  # what this router sent it since

    @property
    def url(self) -> str:
        return self.info.url

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def block_size(self) -> int | None:
        return self.info.block_size

    def as_dict(self) -> dict:
        return {**self.info.model_dump(), "healthy": self.healthy, "static": self.static,
                "in_flight_requests": self.in_flight_requests, "in_flight_tokens": self.in_flight_tokens,
                "in_flight_prefill_tokens": self.in_flight_prefill_tokens,
                "served": self.served, "failed": self.failed, "restarts": self.restarts,
                "seconds_since_heartbeat": None if self.static else round(time.monotonic() - self.last_seen, 1)}


class Registry:
    def __init__(self, expiry: float = 10.0, fail_threshold: int = 3, success_threshold: int = 2) -> None:
        self.expiry = expiry
        self.fail_threshold = fail_threshold
        self.success_threshold = success_threshold
        self._instances: dict[str, Instance] = {}
        self._pids: dict[str, tuple[int | None, int]] = {}  # url -> (last pid, restarts): outlives expiry
        self.on_join: Callable[[Instance], None] = lambda instance: None  # a new or restarted process at a url
        self.on_leave: Callable[[str], None] = lambda url: None  # a url forgotten (unregistered, expired)

    # ---- membership ------------------------------------------------------------------------------

    def register(self, info: Registration, static: bool = False) -> tuple[Instance, bool]:
        """Record a heartbeat. Returns the instance and whether it needs a probe now (new, restarted,
        or out of the pool)."""
        known = self._instances.get(info.url)
        if known is not None and known.info.pid == info.pid:
            self._announced(known, info)
            known.info, known.last_seen = info, time.monotonic()
            return known, not known.healthy
        if known is not None:
            log.info("%s restarted (pid %s -> %s)", info.url, known.info.pid, info.pid)
            self._lose(known, "the instance restarted")
        last_pid, restarts = self._pids.get(info.url, (info.pid, 0))
        restarts += last_pid != info.pid
        self._pids[info.url] = (info.pid, restarts)
        instance = self._instances[info.url] = Instance(info, static=static, restarts=restarts)
        log.info("%s instance %s announced itself (host %s); probing it", info.role, info.url, info.host_id)
        self._warn_if_unpairable(instance)
        self.on_join(instance)
        return instance, True

    def _warn_if_unpairable(self, instance: Instance) -> None:
        """A prefill or decode instance whose model, KV dtype or layout no instance of the other side shares
        is never paired: say so at once, naming both sides' keys."""
        other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}.get(instance.role)
        peers = [i for i in self._instances.values() if i.role == other] if other else []
        keys = {i.info.compatibility_key for i in peers}
        if peers and instance.info.compatibility_key not in keys:
            log.warning("%s instance %s cannot be paired with any %s instance: its KV is %r, theirs %s (model, "
                        "KV dtype and layout must match)", instance.role, instance.url, other,
                        instance.info.compatibility_key, " / ".join(repr(k) for k in sorted(keys, key=str)))

    @staticmethod
    def _announced(known: Instance, info: Registration) -> None:
        """The same process changed role in place or started or ended a drain: it stays in the pool."""
        if known.info.role != info.role:
            log.info("%s changed role in place: %s -> %s", info.url, known.info.role, info.role)
        if known.info.draining != info.draining:
            log.info("%s %s", info.url, "is draining: no new requests go to it" if info.draining
                     else "takes requests again")

    def unregister(self, url: str) -> None:
        if (instance := self._instances.pop(url, None)) is not None:
            log.info("%s instance %s unregistered", instance.role, url)
            self._lose(instance, "the instance unregistered (it is shutting down)")
            self.on_leave(url)

    def expire(self) -> None:
        now = time.monotonic()
        for instance in [i for i in self._instances.values() if not i.static and now - i.last_seen > self.expiry]:
            log.warning("%s instance %s sent no heartbeat for %.0f s: forgotten", instance.role, instance.url,
                        now - instance.last_seen)
            del self._instances[instance.url]
            self._lose(instance, f"no heartbeat for {now - instance.last_seen:.0f} s")
            self.on_leave(instance.url)

    def all(self) -> list[Instance]:
        return sorted(self._instances.values(), key=lambda i: (i.role, i.url))

    def healthy(self, role: str | None = None) -> list[Instance]:
        """In the pool and taking requests (a draining instance finishes those it has and takes no new ones)."""
        return [i for i in self.all() if i.healthy and not i.info.draining and (role is None or i.role == role)]

    def has_pd(self) -> bool:
        return any(i.role in (Role.PREFILL, Role.DECODE) for i in self._instances.values())

    # ---- health ----------------------------------------------------------------------------------

    def probe_succeeded(self, instance: Instance) -> None:
        instance.fails = 0
        instance.successes += 1
        needed = self.success_threshold if instance.ever_healthy else 1
        if not instance.healthy and instance.successes >= needed and self._instances.get(instance.url) is instance:
            instance.healthy = instance.ever_healthy = True
            log.info("%s instance %s is in the pool", instance.role, instance.url)

    def probe_failed(self, instance: Instance, reason: str, at_once: bool = False) -> None:
        """A failed probe; `at_once` (a request found it unreachable) takes it out without waiting."""
        instance.successes = 0
        instance.fails += 1
        if instance.healthy and (at_once or instance.fails >= self.fail_threshold):
            instance.healthy = False
            log.warning("%s instance %s left the pool: %s", instance.role, instance.url, reason)
            self._lose(instance, reason)

    def _lose(self, instance: Instance, reason: str) -> None:
        instance.healthy = False
        for watcher in list(instance.watchers):
            watcher(reason)

    # ---- load ------------------------------------------------------------------------------------

    @contextmanager
    def track(self, instance: Instance, tokens: int, on_lost: Callable[[str], None]) -> Iterator[None]:
        """Count a request as in flight on `instance` for the block; `on_lost` hears if the instance is lost."""
        instance.in_flight_requests += 1
        instance.in_flight_tokens += tokens
        instance.served += 1
        instance.watchers.add(on_lost)
        try:
            yield
        finally:
            instance.watchers.discard(on_lost)
            instance.in_flight_requests -= 1
            instance.in_flight_tokens -= tokens
