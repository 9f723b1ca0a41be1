"""Which instances serve a request: a compatible (prefill, decode) pair and its transport, or a mixed one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.balancing.policies import Policy, RoutedRequest
from pdserve.config.roles import Role
from pdserve.router.prefill_decider import Decision, PrefillDecider
from pdserve.router.registry import Instance, Registry
from pdserve.transport import choose_protocol


@dataclass(frozen=True)
class Route:
    first: Instance  # the prefill instance, or the mixed one
    decode: Instance | None = None
    transport: str | None = None  # how P writes into D's cache
    decision: Decision | None = None  # conditional disaggregation: why `first` (a decode instance) prefills itself


def pair_transport(prefill: Instance, decode: Instance) -> str | None:
    same_host = bool(prefill.info.host_id) and prefill.info.host_id == decode.info.host_id
    return choose_protocol(prefill.info.transports, decode.info.transports, same_host)


def compatible(prefill: Instance, decode: Instance) -> bool:
    """Same model, dtype and cache geometry (the instance's KV layout, every head), and a shared transport;
    tensor-parallel sizes may differ: both sides keep the whole layout, each rank its heads of it."""
    return (prefill.info.compatibility_key == decode.info.compatibility_key
            and pair_transport(prefill, decode) is not None)


class Selector:
    def __init__(self, registry: Registry, prefill_policy: Policy, decode_policy: Policy,
                 mixed_fallback: bool = False, decider: PrefillDecider | None = None,
                 on_decision: Callable[[Decision], None] = lambda d: None) -> None:
        self.registry = registry
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.mixed_fallback = mixed_fallback
        self.decider, self.on_decision = decider, on_decision

    def pick(self, request: RoutedRequest, exclude: frozenset[str] | set[str] = frozenset()) -> Route | None:
        if request.single:
            return self._pick_single(request, exclude)
        prefill = [i for i in self.registry.healthy(Role.PREFILL) if i.url not in exclude]
        decode = [i for i in self.registry.healthy(Role.DECODE) if i.url not in exclude]
        pairable = [p for p in prefill if any(compatible(p, d) for d in decode)]
        if pairable:
            p = self.prefill_policy.choose(pairable, request)
            d = self.decode_policy.choose([d for d in decode if compatible(p, d)], request)
            if self.decider is not None:
                decision = self.decider.decide(request, p, d)
                self.on_decision(decision)
                if decision.local:
                    return Route(d, decision=decision)
            return Route(p, d, pair_transport(p, d))
        mixed = [i for i in self.registry.healthy(Role.MIXED) if i.url not in exclude]
        if mixed and (self.mixed_fallback or not self.registry.has_pd()):
            return Route(self.decode_policy.choose(mixed, request))
        return None

    def _pick_single(self, request: RoutedRequest, exclude: frozenset[str] | set[str]) -> Route | None:
        """A prompt-scoring request: a mixed instance, else a prefill instance (it computes prompts) alone."""
        for role, policy in ((Role.MIXED, self.decode_policy), (Role.PREFILL, self.prefill_policy)):
            if candidates := [i for i in self.registry.healthy(role) if i.url not in exclude]:
                return Route(policy.choose(candidates, request))
        return None

    def can_serve(self) -> bool:
        """pick() would find a route (asked without moving any policy's state)."""
        return self.can_serve_without(set())

    def can_serve_without(self, excluded: set[str]) -> bool:
        """can_serve(), the `excluded` urls left out."""
        prefill = [i for i in self.registry.healthy(Role.PREFILL) if i.url not in excluded]
        decode = [i for i in self.registry.healthy(Role.DECODE) if i.url not in excluded]
        if any(compatible(p, d) for p in prefill for d in decode):
            return True
        mixed = [i for i in self.registry.healthy(Role.MIXED) if i.url not in excluded]
        return bool(mixed) and (self.mixed_fallback or not self.registry.has_pd())

    def why_not(self) -> str:
        prefill, decode = self.registry.healthy(Role.PREFILL), self.registry.healthy(Role.DECODE)
        if prefill and decode:
            return ("no healthy prefill/decode pair is compatible (compatibility key, tensor-parallel size or "
                    "transport differ)")
        if self.registry.has_pd():
            return (f"no complete prefill/decode pair is healthy ({len(prefill)} prefill, {len(decode)} decode"
                    f"{'' if self.mixed_fallback else '; --mixed-fallback is off'})")
        return "no instance is registered and healthy"
