"""The router's admission: a request gets a route only among instances that can serve it within the SLOs
(`--ttft-slo-ms` on the instance that computes the prompt, `--tpot-slo-ms` on the one that decodes it), and
only within its key's rate limit (`--rate-limit`); else it is answered 429 at once, with `Retry-After`.

Each instance's load comes from polling its /load every `--load-interval` seconds (LoadPoller); what this
router sent it since counts on top (Instance.sent). A high-priority request counts only the queue at its
priority or above, so it may be admitted where a low-priority one is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pdserve.admission.correction import Correction
from pdserve.admission.floor import below_floor
from pdserve.admission.load import LoadReport
from pdserve.admission.metrics import AdmissionMetrics
from pdserve.admission.predictor import SLO, Refusal, judge_tpot, judge_ttft, predict_decode_step
from pdserve.admission.rate_limit import RateLimits, client_key
from pdserve.balancing.policies import RoutedRequest
from pdserve.balancing.prefix_index import PrefixIndex
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
                 selector: Selector, api_key: str | None, kv_index: KVIndex | None = None, peers: int = 1) -> None:
        """`peers`: routers admitting to the same instances (this one included), each sent a like share."""
        self.slo, self.limits, self.metrics = slo, limits, metrics
        self.registry, self.selector, self.api_key = registry, selector, api_key
        self.kv_index = kv_index  # what each instance caches (KV events): a prompt's cached part is not computed
        self.peers = max(1, peers)
        self.router_id = uuid.uuid4().hex[:12]  # the instances acknowledge what they took of ours (admission/sent.py)
        self._seq = itertools.count(1)
        self.ttft_correction: dict[str, Correction] = {}  # by instance url
        self.recent = PrefixIndex()  # the prompt blocks this router sent each instance lately (see _cached_tokens)

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
        reporting = [i for i in self.registry.all() if i.load is not None]
        sent = {i.url: self._sent(i, request) for i in reporting}
        decode_step = self._decode_step(request, reporting, sent, now)
        for instance in reporting:
            tokens, streams = sent[instance.url]
            refusal, todo = None, None
            decodes = instance.role in (Role.DECODE, Role.MIXED) and request.decodes
            if instance.role in (Role.PREFILL, Role.MIXED):
                todo = request.num_tokens - self._cached_tokens(instance, request)
                correction = self._correction(instance.url).factor
                then = decode_step if instance.role == Role.PREFILL else 0.0
                ttft, refusal = judge_ttft(self.slo, instance.load, todo, request.priority, tokens, now, correction,
                                           then)
                if ttft is not None:
                    admitted.predicted_ttft[instance.url] = ttft
            elif instance.role == Role.DECODE and (late := self._judge_local_prefill(instance, request, tokens,
                                                                                        streams, now)):
                refusals.append(late)  # not excluded: it may still decode what a prefill instance computes
            if refusal is None and decodes:
                refusal = judge_tpot(self.slo, instance.load, streams)
            if refusal is not None and below_floor(self.slo, instance.load, todo, decodes, streams):
                refusal = None
            if refusal is not None:
                admitted.excluded.add(instance.url)
                refusals.append(refusal)
        return refusals

    def _sent(self, instance: Instance, request: RoutedRequest) -> tuple[int, int]:
        """(prompt tokens, streams) this router and its peers sent the instance since its report counted them."""
        tokens, streams = instance.sent.since(_counted_until(instance.load), request.priority)
        return tokens * self.peers, streams * self.peers

    @staticmethod
    def _decode_step(request: RoutedRequest, reporting: list[Instance], sent: dict[str, tuple[int, int]],
                     now: float) -> float:
        """The step a prompt computed by a prefill instance waits for on the quickest decode instance before its
        first token (0 where no decode instance has a step-cost fit, or the request does not decode)."""
        if not request.decodes:
            return 0.0
        return min((predict_decode_step(i.load, *sent[i.url], now) for i in reporting if i.role == Role.DECODE),
                   default=0.0)

    def _judge_local_prefill(self, instance: Instance, request: RoutedRequest, sent_tokens: int, sent_streams: int,
                             now: float) -> Refusal | None:
        """A decode instance may compute a prompt itself (conditional disaggregation, or as the only instance left to
        compute it): where its first token would miss the TTFT objective, the route leaves the prompt to a prefill
        instance, and where none can take it either, the refusal returned is the answer. The instance is not
        excluded: it still decodes what a prefill instance computes."""
        todo = request.num_tokens - self._cached_tokens(instance, request)
        _, refusal = judge_ttft(self.slo, instance.load, todo, request.priority, sent_tokens, now,
                                self._correction(instance.url).factor)
        if refusal is None or below_floor(self.slo, instance.load, todo, False, sent_streams):
            return None
        request.slow_local_prefill.add(instance.url)
        return refusal

    def _cached_tokens(self, instance: Instance, request: RoutedRequest) -> int:
        """The prompt tokens the instance will find cached: what its KV events say it holds, or what this router
        sent it lately (a prompt still queued or computing there is cached by the time this one is scheduled)."""
        bs = instance.block_size
        if not bs:
            return 0
        hashes = request.lookup_hashes(bs)
        held = 0
        if self.kv_index is not None and self.kv_index.tracks(instance.url):
            held = self.kv_index.cached_blocks(instance.url, hashes)
        return max(held, self.recent.matched(instance.url, hashes)) * bs

    def routed(self, route: Route, request: RoutedRequest) -> None:
        """A route was taken: its instances' queues grow by this request until their reports acknowledge it."""
        if request.admitted is not None:
            request.admitted.routed.append(route.first.url)
        seq = next(self._seq)
        request.sent_tag = f"{self.router_id}:{seq}"
        route.first.sent.add(request.num_tokens - self._cached_tokens(route.first, request), request.priority, seq=seq)
        if route.decode is not None:
            route.decode.sent.add(0, request.priority, seq=seq)
        for instance in (route.first, route.decode):  # either caches the prompt's blocks
            if instance is not None and instance.block_size:
                self.recent.remember(instance.url, request.lookup_hashes(instance.block_size))

    def _correction(self, url: str) -> Correction:
        return self.ttft_correction.setdefault(url, Correction())

    def first_token(self, admitted: Admitted, seconds: float) -> None:
        """A stream's first event came `seconds` after it was routed: against the TTFT predicted on the instance
        that computed its prompt."""
        url = next((u for u in admitted.routed if u in admitted.predicted_ttft), None)
        predicted = admitted.predicted_ttft.get(url) if url is not None else None
        self.metrics.observe_ttft(predicted, seconds)
        if url is not None:
            correction = self._correction(url)
            correction.observe(predicted, seconds)
            self.metrics.ttft_correction.labels(url).set(correction.factor)

    def finished(self, admitted: Admitted, completion_tokens: int) -> None:
        if self.limits is not None and admitted.key is not None:
            self.limits.charge(admitted.key, completion_tokens)


def _counted_until(report: LoadReport) -> float:
    """What this router sent before this time is in the report: an instance that acknowledges what it took says
    so itself (nothing to forget by time), else the poll's start."""
    return report.time if report.acked < 0 else 0.0


class LoadPoller:
    """GET /load on every instance every `interval` seconds; a report is timed by the poll's start on this
    router's clock (instances on other hosts have other clocks), and what it acknowledges is forgotten."""

    def __init__(self, registry: Registry, client: aiohttp.ClientSession, interval: float, router_id: str) -> None:
        self.registry, self.client, self.interval, self.router_id = registry, client, interval, router_id
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
            async with self.client.get(f"{instance.url}/load", params={"router": self.router_id},
                                       timeout=aiohttp.ClientTimeout(total=max(1.0, 5 * self.interval))) as r:
                if r.status != 200:
                    return
                report = self._decoder.decode(await r.read())
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
            return  # health checks decide whether it is gone; its last report stays until then
        if report is not None and report.acked >= 0:
            instance.sent.acknowledge(report.acked)
        instance.load = None if report is None else msgspec.structs.replace(report, time=asked)
