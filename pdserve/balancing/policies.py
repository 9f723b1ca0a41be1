"""How one endpoint is picked among the healthy candidates: the router's instances of a role, or an API
server's data-parallel engine ranks.

Loads are what the picker itself has in flight on each candidate (requests and prompt tokens), as
FastDeploy's and SGLang's routers count them: no scrape on the request path.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pdserve.balancing.prefix_index import CacheView
from pdserve.config.lora import lora_hash_root
from pdserve.kv.block_hash import chained_hashes
from pdserve.kv_events.index import KVIndex

DEFAULT_BLOCK_SIZE = 64  # an instance that did not say its block size (a static list without it)


class Candidate(Protocol):
    """What a policy reads of an endpoint (the router's Instance, the API server's engine rank)."""

    @property
    def url(self) -> str: ...

    @property
    def block_size(self) -> int | None: ...

    in_flight_requests: int
    in_flight_tokens: int  # prompt tokens of the requests in flight
    in_flight_prefill_tokens: int  # ... of those still waiting for their first token, less their cached part
    served: int  # requests sent there


Instance = TypeVar("Instance", bound=Candidate)

POLICIES = ("round_robin", "random", "power_of_two", "least_tokens", "least_requests", "cache_aware")


@dataclass
class RoutedRequest:
    """What the policies know of a request: its prompt tokens (None when the router has no tokenizer)."""

    token_ids: list[int] | None
    num_tokens: int  # exact with a tokenizer, else estimated from the text
    # scores its prompt (echo + logprobs, prompt_logprobs): one instance computes it all, no PD pair
    single: bool = False
    decodes: bool = True  # it opens a stream of tokens: not a prompt scored, not max_tokens <= 1 (admission's TPOT)
    sent_tag: str | None = None  # "router id:sequence number" of its route, which the instances acknowledge
    predicted_cached_tokens: int | None = None  # cache_aware: what it expects the chosen instance to have cached
    route_cost: float | None = None  # cache_aware: the chosen instance's cost, in KV blocks
    priority: int = 0  # the request's `priority` field (admission counts the queue at its priority and above)
    admitted: Any = None  # router/admission.Admitted, when the router admits by SLO or rate limit
    lora: str | None = None  # the LoRA adapter its `model` names: only instances serving it may take it
    # decode instances whose own computing of its prompt would miss the TTFT objective (admission): conditional
    # disaggregation leaves the prompt to a prefill instance there
    slow_local_prefill: set[str] = field(default_factory=set)
    _hashes: dict[int, list[bytes]] = field(default_factory=dict)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The engine's chained hashes of the prompt's full blocks (block_pool.hash_block): what its cache
        holds once the prompt is computed."""
        if self.token_ids is None:
            return []
        if block_size not in self._hashes:
            self._hashes[block_size] = chained_hashes(self.token_ids, block_size, lora_hash_root(self.lora))
        return self._hashes[block_size]

    def lookup_hashes(self, block_size: int) -> list[bytes]:
        """The blocks a prefix-cache lookup may take: all full ones but one that ends with the prompt's last
        token, which is always computed (its logits give the first new token)."""
        return self.block_hashes(block_size)[:max(self.num_tokens - 1, 0) // block_size]


class Policy(ABC):
    @abstractmethod
    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        """One of `candidates` (never empty, sorted by url)."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        return candidates[next(self._turn) % len(candidates)]


class Random(Policy):
    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        return random.choice(candidates)


class LeastRequests(Policy):
    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        return _least(candidates, lambda i: (i.in_flight_requests, i.in_flight_tokens))


class LeastTokens(Policy):
    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        return _least(candidates, lambda i: (i.in_flight_tokens, i.in_flight_requests))


class PowerOfTwo(Policy):
    """Two at random, the less loaded of them: near least-load without herding on one stale minimum."""

    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        if len(candidates) == 1:
            return candidates[0]
        a, b = random.sample(candidates, 2)
        return min((a, b), key=lambda i: (i.in_flight_requests, i.in_flight_tokens))


class CacheAware(Policy):
    """Prefix affinity traded against load by one cost, in KV blocks, after Dynamo's KV router:

        cost = overlap_weight x (prompt blocks the instance would compute + prompt blocks queued for prefill there)
               + decode_weight x (prompt blocks of the requests decoding there)

    and the cheapest wins (ties: fewer requests in flight, then fewer served). Dynamo weighs the decoding
    requests' blocks fully (1.0): on a GPU they hold the scarce memory. On this CPU box compute is what is
    scarce: a prompt waits for the prefills ahead of it, while decoding streams only share its steps, and
    measured (docs/measurements.md, KV routing) a full weight moved later turns off their prefix's holder
    whenever it had a long stream in flight. What an instance caches is read from its KV events when it
    publishes them (kv_events/index.py: exact, evictions and the host tier included, whichever router sent
    the prompts); else from what this policy sent it (an LRU per instance, approximate).
    """

    def __init__(self, overlap_weight: float = 1.0, decode_weight: float = 0.1,
                 kv_index: KVIndex | None = None) -> None:
        self.overlap_weight, self.decode_weight = overlap_weight, decode_weight
        self.cache = CacheView(kv_index)

    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        costs = {i.url: self._cost(i, request) for i in candidates}
        chosen = min(candidates, key=lambda i: (costs[i.url][0], i.in_flight_requests, i.served))
        request.predicted_cached_tokens = costs[chosen.url][1]
        request.route_cost = costs[chosen.url][0]
        self.cache.sent(chosen.url, request.block_hashes(chosen.block_size or DEFAULT_BLOCK_SIZE))
        return chosen

    def _cost(self, instance: Instance, request: RoutedRequest) -> tuple[float, int]:
        """(the cost, the prompt tokens it would find cached)"""
        block_size = instance.block_size or DEFAULT_BLOCK_SIZE
        cached = self.cache.cached_blocks(instance.url, request.lookup_hashes(block_size)) * block_size
        prefill = max(request.num_tokens - cached, 0) + instance.in_flight_prefill_tokens
        decoding = max(instance.in_flight_tokens - instance.in_flight_prefill_tokens, 0)
        return (self.overlap_weight * prefill + self.decode_weight * decoding) / block_size, cached


def _least(candidates: list[Instance], load) -> Instance:  # noqa: ANN001
    """The least loaded; ties go round robin by how many each has served, so idle instances all get work."""
    return min(candidates, key=lambda i: (*load(i), i.served))


def make_policy(name: str, **cache_aware: object) -> Policy:
    if name == "cache_aware":
        return CacheAware(**cache_aware)
    classes = {"round_robin": RoundRobin, "random": Random, "power_of_two": PowerOfTwo,
               "least_tokens": LeastTokens, "least_requests": LeastRequests}
    if name not in classes:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return classes[name]()
