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
    predicted_cached_tokens: int | None = None  # cache_aware: prompt tokens `first` should find in its cache


def pair_transport(prefill: Instance, decode: Instance) -> str | None:
    same_host = bool(prefill.info.host_id) and prefill.info.host_id == decode.info.host_id
    return choose_protocol(prefill.info.transports, decode.info.transports, same_host)


def compatible(prefill: Instance, decode: Instance) -> bool:
    """Same model, dtype and cache geometry (the instance's KV layout, every head), and a shared transport;
    tensor-parallel sizes may differ: both sides keep the whole layout, each rank its heads of it."""
    return (prefill.info.compatibility_key == decode.info.compatibility_key
            and pair_transport(prefill, decode) is not None)


WARM_SLACK = 8  # requests in flight a warm instance may have beyond the least busy candidate (untuned)


class Selector:
    """Routes are a compatible (prefill, decode) pair or a mixed instance, all chosen among by the same
    policies: the instance that computes the prompt (a prefill or a mixed one) by the prefill policy, then a
    decode instance for a prefill one by the decode policy. With mixed instances alone, the decode policy
    picks (each both computes and decodes)."""

    def __init__(self, registry: Registry, prefill_policy: Policy, decode_policy: Policy,
                 decider: PrefillDecider | None = None,
                 on_decision: Callable[[Decision], None] = lambda d: None) -> None:
        self.registry = registry
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.decider, self.on_decision = decider, on_decision

    def pick(self, request: RoutedRequest, exclude: frozenset[str] | set[str] = frozenset()) -> Route | None:
        if request.single:
            return self._pick_single(request, exclude)
        decode = self._decode_side(exclude, request)
        prefill = self._healthy(Role.PREFILL, exclude, request)
        pairable = [p for p in prefill if any(compatible(p, d) for d in decode)]
        whole = self._whole(prefill, exclude, request)
        request.predicted_cached_tokens = None  # each policy that predicts sets it
        if not pairable:
            if not whole:
                return None
            chosen = self.decode_policy.choose(self._warm_first(whole, request), request)
            return Route(chosen, predicted_cached_tokens=request.predicted_cached_tokens)
        first = self.prefill_policy.choose(self._warm_first(pairable + whole, request), request)
        predicted = request.predicted_cached_tokens
        if first.role != Role.PREFILL:
            return Route(first, predicted_cached_tokens=predicted)
        d = self.decode_policy.choose(self._warm_first([d for d in decode if compatible(first, d)], request), request)
        if self.decider is not None:
            decision = self.decider.decide(request, first, d)
            self.on_decision(decision)
            if decision.local:
                return Route(d, decision=decision, predicted_cached_tokens=request.predicted_cached_tokens)
        return Route(first, d, pair_transport(first, d), predicted_cached_tokens=predicted)

    def _healthy(self, role: Role, exclude: frozenset[str] | set[str], request: RoutedRequest | None = None
                 ) -> list[Instance]:
        """The role's healthy instances but the excluded ones, and for a LoRA request those serving its adapter."""
        lora = request.lora if request is not None else None
        return [i for i in self.registry.healthy(role)
                if i.url not in exclude and (lora is None or lora in i.info.loras)]

    def _decode_side(self, exclude: frozenset[str] | set[str], request: RoutedRequest | None = None
                     ) -> list[Instance]:
        """Who takes the decode side of a pair: decode instances, and mixed ones that may change role (they hold
        the decode side's parts: a prefill instance's partner when no decode instance is left)."""
        mixed = [i for i in self._healthy(Role.MIXED, exclude, request) if Role.DECODE in i.info.pd_sides]
        return self._healthy(Role.DECODE, exclude, request) + mixed

    def _whole(self, prefill: list[Instance], exclude: frozenset[str] | set[str],
               request: RoutedRequest | None = None) -> list[Instance]:
        """Who computes a whole request: mixed instances, and decode ones while no prefill instance is there to
        pair them with (a decode instance computes a prompt itself, as conditional disaggregation's local
        prefill does)."""
        mixed = self._healthy(Role.MIXED, exclude, request)
        if prefill:
            return mixed
        late = request.slow_local_prefill if request is not None else set()  # admission: its first token would be late
        return mixed + [d for d in self._healthy(Role.DECODE, exclude, request) if d.url not in late]

    def _warm_first(self, candidates: list[Instance], request: RoutedRequest) -> list[Instance]:
        """For a LoRA request, the instances whose last load report had its adapter in a step (so in a device
        slot), unless they have more than WARM_SLACK requests in flight beyond the least busy candidate (then
        a cold one is worth the adapter's copy-in). Without reports (admission off: no polling), all of them."""
        if request.lora is None or len(candidates) < 2:
            return candidates
        least = min(i.in_flight_requests for i in candidates)
        warm = [i for i in candidates if i.load is not None and request.lora in i.load.loras
                and i.in_flight_requests <= least + WARM_SLACK]
        return warm or candidates

    def serves_lora(self, name: str) -> bool:
        """Some registered instance serves this LoRA adapter (a `model` naming it is an adapter request)."""
        return any(name in i.info.loras for i in self.registry.all())

    def _pick_single(self, request: RoutedRequest, exclude: frozenset[str] | set[str]) -> Route | None:
        """A prompt-scoring request: a mixed instance, else a prefill instance (it computes prompts) alone."""
        for role, policy in ((Role.MIXED, self.decode_policy), (Role.PREFILL, self.prefill_policy)):
            if candidates := self._healthy(role, exclude, request):
                return Route(policy.choose(candidates, request))
        return None

    def can_serve(self) -> bool:
        """pick() would find a route (asked without moving any policy's state)."""
        return self.can_serve_without(set())

    def can_serve_without(self, excluded: set[str], request: RoutedRequest | None = None) -> bool:
        """can_serve(), the `excluded` urls left out (and for a LoRA request, the instances not serving it)."""
        decode = self._decode_side(excluded, request)
        prefill = self._healthy(Role.PREFILL, excluded, request)
        return any(compatible(p, d) for p in prefill for d in decode) or bool(self._whole(prefill, excluded, request))

    def can_route(self, request: RoutedRequest, excluded: set[str]) -> bool:
        """pick() would find a route for this request, the `excluded` urls left out (no policy state moves)."""
        if request.single:
            return bool(self._healthy(Role.MIXED, excluded, request) or self._healthy(Role.PREFILL, excluded, request))
        return self.can_serve_without(excluded, request)

    def why_not(self) -> str:
        prefill, decode = self.registry.healthy(Role.PREFILL), self.registry.healthy(Role.DECODE)
        if prefill and decode:
            keys = " / ".join(sorted({f"{i.role} {i.info.compatibility_key}" for i in prefill + decode}))
            return ("no healthy prefill/decode pair is compatible: model, KV dtype and layout (the compatibility "
                    f"key) or a shared transport differ ({keys})")
        if self.registry.has_pd():
            return (f"no complete prefill/decode pair is healthy ({len(prefill)} prefill, {len(decode)} decode) "
                    "and no mixed instance is")
        return "no instance is registered and healthy"
