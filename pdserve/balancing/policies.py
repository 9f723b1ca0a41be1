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
from typing import Protocol, TypeVar

from pdserve.balancing.prefix_index import PrefixIndex
from pdserve.engine.block_pool import hash_block


class Candidate(Protocol):
    """What a policy reads of an endpoint (the router's Instance, the API server's engine rank)."""

    @property
    def url(self) -> str: ...

    @property
    def block_size(self) -> int | None: ...

    in_flight_requests: int
    in_flight_tokens: int  # prompt tokens of the requests in flight
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
    _hashes: dict[int, list[bytes]] = field(default_factory=dict)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The engine's chained hashes of the prompt's full blocks (block_pool.hash_block)."""
        if self.token_ids is None:
            return []
        if block_size not in self._hashes:
            hashes: list[bytes] = []
            for i in range(len(self.token_ids) // block_size):
                hashes.append(hash_block(hashes[-1] if hashes else None,
                                         self.token_ids[i * block_size:(i + 1) * block_size]))
            self._hashes[block_size] = hashes
        return self._hashes[block_size]


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
    """Prefix affinity: the instance that was sent the longest run of this prompt's leading blocks.

    The router remembers which block hashes it sent where (an LRU per instance, an approximation of
    each engine's prefix cache). When the load is imbalanced (the most loaded instance has more than
    `balance_abs` in-flight tokens over the least and more than `balance_rel` times its load), or no
    instance holds at least `min_match` of the prompt, it picks by least tokens instead.
    """

    def __init__(self, balance_abs: int = 4096, balance_rel: float = 1.5, min_match: float = 0.3,
                 max_blocks_per_instance: int = 100_000) -> None:
        self.balance_abs, self.balance_rel, self.min_match = balance_abs, balance_rel, min_match
        self.index = PrefixIndex(max_blocks_per_instance)
        self._fallback = LeastTokens()

    def choose(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        block_size = candidates[0].block_size or 64
        hashes = request.block_hashes(block_size)
        chosen = None
        if hashes and not self._imbalanced(candidates):
            best = max(candidates, key=lambda i: (self.matched(i.url, hashes), -i.in_flight_tokens))
            if self.matched(best.url, hashes) >= self.min_match * len(hashes):
                chosen = best
        chosen = chosen or self._fallback.choose(candidates, request)
        self.index.remember(chosen.url, hashes)
        return chosen

    def matched(self, url: str, hashes: list[bytes]) -> int:
        return self.index.matched(url, hashes)

    def _imbalanced(self, candidates: list[Instance]) -> bool:
        loads = [i.in_flight_tokens for i in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo


def _least(candidates: list[Instance], load) -> Instance:  # noqa: ANN001
    """The least loaded; ties go round robin by how many each has served, so idle instances all get work."""
    return min(candidates, key=lambda i: (*load(i), i.served))


def make_policy(name: str, **cache_aware: float) -> Policy:
    if name == "cache_aware":
        return CacheAware(**cache_aware)
    classes = {"round_robin": RoundRobin, "random": Random, "power_of_two": PowerOfTwo,
               "least_tokens": LeastTokens, "least_requests": LeastRequests}
    if name not in classes:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return classes[name]()
