"""The router's admission: a request gets a route only among instances that can serve it within the SLOs
(`--ttft-slo-ms` on the instance that computes the prompt, `--tpot-slo-ms` on the one that decodes it), and
only within its key's rate limit (`--rate-limit`); else it is answered 429 at once, with `Retry-After`.

Each instance's load comes from polling its /load every `--load-interval` seconds (LoadPoller); what this
router sent it since counts on top (Instance.sent). A high-priority request counts only the queue at its
priority or above, so it may be admitted where a low-priority one is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pdserve.admission.load import LoadReport
from pdserve.admission.metrics import AdmissionMetrics
from pdserve.admission.predictor import SLO, Refusal, judge_tpot, judge_ttft
from pdserve.admission.rate_limit import RateLimits, client_key
from pdserve.balancing.policies import RoutedRequest
from pdserve.config.roles import Role
from pdserve.kv_events.index import KVIndex
from pdserve.router.registry import Instance, Registry
from pdserve.router.selector import Route, Selector

log = logging.getLogger("pdserve.router")


@dataclass
class Admitted:
    key: str | None
    excluded: set[str]  # instances that would miss an SLO: routes avoid them
    predicted_ttft: dict[str, float]  # per instance that computes prompts, where predicted
    routed: list[str] = field(default_factory=list)  # the urls of the instances that computed its prompt


class RouterAdmission:
    def __init__(self, slo: SLO, limits: RateLimits | None, metrics: AdmissionMetrics, registry: Registry,
                 selector: Selector, api_key: str | None, kv_index: KVIndex | None = None) -> None:
        self.slo, self.limits, self.metrics = slo, limits, metrics
        self.registry, self.selector, self.api_key = registry, selector, api_key
        self.kv_index = kv_index  # what each instance caches (KV events): a prompt's cached part is not computed

    def admit(self, headers: Mapping[str, str], body: dict, request: RoutedRequest, received: float
              ) -> Admitted | Refusal:
        """`received`: the request's arrival (time.monotonic()), for the time the decision took."""
        priority = request.priority
        admitted = Admitted(None, set(), {})
        refusals = self._judge(request, admitted) if self.slo.enabled else []
        refusal = None
        if refusals and not self.selector.can_route(request, admitted.excluded):
            refusal = min(refusals, key=lambda r: r.retry_after)
        if refusal is None and self.limits is not None:
            user = body.get("user") if isinstance(body.get("user"), str) else None
            admitted.key = client_key(headers.get("authorization"), user, self.api_key)
            refusal = self.limits.admit(admitted.key, request.num_tokens)
        self.metrics.count(refusal, priority, time.monotonic() - received)
        if refusal is not None:
            return refusal
        request.admitted = admitted
        return admitted

    def _judge(self, request: RoutedRequest, admitted: Admitted) -> list[Refusal]:
        refusals, now = [], time.time()
        for instance in self.registry.all():
            if instance.load is None:
                continue
            tokens, streams = instance.sent.since(instance.load.time, request.priority)
            refusal = None
            if instance.role in (Role.PREFILL, Role.MIXED):
                todo = request.num_tokens - self._cached_tokens(instance, request)
                ttft, refusal = judge_ttft(self.slo, instance.load, todo, request.priority, tokens, now)
                if ttft is not None:
                    admitted.predicted_ttft[instance.url] = ttft
            if refusal is None and instance.role in (Role.DECODE, Role.MIXED) and request.decodes:
                refusal = judge_tpot(self.slo, instance.load, streams)
            if refusal is not None:
                admitted.excluded.add(instance.url)
                refusals.append(refusal)
        return refusals

    def _cached_tokens(self, instance: Instance, request: RoutedRequest) -> int:
        bs = instance.block_size
        if self.kv_index is None or not bs or not self.kv_index.tracks(instance.url):
            return 0
        return self.kv_index.cached_blocks(instance.url, request.lookup_hashes(bs)) * bs

    def routed(self, route: Route, request: RoutedRequest) -> None:
        """A route was taken: its instances' queues grow by this request until their next report says so."""
        if request.admitted is not None:
            request.admitted.routed.append(route.first.url)
        route.first.sent.add(request.num_tokens, request.priority)
        if route.decode is not None:
            route.decode.sent.add(0, request.priority)

    def finished(self, admitted: Admitted, completion_tokens: int) -> None:
        if self.limits is not None and admitted.key is not None:
            self.limits.charge(admitted.key, completion_tokens)


class LoadPoller:
    """GET /load on every instance every `interval` seconds; a report is timed by the poll's start on this
    router's clock (instances on other hosts have other clocks)."""

    def __init__(self, registry: Registry, client: aiohttp.ClientSession, interval: float) -> None:
        self.registry, self.client, self.interval = registry, client, interval
        self._decoder = msgspec.json.Decoder(LoadReport | None)

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await asyncio.gather(*(self.poll(i) for i in self.registry.all()))
            except Exception:  # a bug here must not end polling for good
                log.exception("load poll round failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def poll(self, instance: Instance) -> None:
        asked = time.time()
        try:
            async with self.client.get(f"{instance.url}/load",
                                       timeout=aiohttp.ClientTimeout(total=max(1.0, 5 * self.interval))) as r:
                if r.status != 200:
                    return
                report = self._decoder.decode(await r.read())
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
            return  # health checks decide whether it is gone; its last report stays until then
        instance.load = None if report is None else msgspec.structs.replace(report, time=asked)
