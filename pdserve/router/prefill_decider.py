"""Conditional disaggregation: per PD request, compute the prompt on the prefill instance (remote) or
let the decode instance compute it itself (local), as Dynamo's disaggregated router and llm-d's
decider do.

Dynamo's rule: prefill remotely only when the part of the prompt the decode instance lacks is longer
than `max_local_prefill_length` tokens and the prefill side is not backed up. pdserve measures the
backlog in prompt tokens: the prefill instance's in-flight prompt tokens (its queue and the chunk it
computes: the router ends a prefill exchange when P answers, right after the first token). At
`max_prefill_queue_tokens` or more, the wait there would cost more than D computing the prompt
itself. And a D with at most `local_prefill_decode_requests` requests in flight computes any prompt
itself: it has few decodes to hold back, and on a box where it borrows P's cores while P is idle
(`pdserve launch --cpu-binding lend`) it computes the prompt on the whole box, where P has its own
cores only. What D lacks is read from its KV events, or where it publishes none, estimated from the blocks the
router sent it before (every PD prompt, local or remote, ends in D's prefix cache). The answer is the
same either way: a local prefill is a mixed instance's request, on D.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.balancing.policies import RoutedRequest
from pdserve.balancing.prefix_index import CacheView
from pdserve.kv_events.index import KVIndex
from pdserve.router.registry import Instance

PD_POLICIES = ("always", "conditional")
REASONS = ("short", "cached", "prefill_busy", "decode_idle", "long", "slow_locally")  # the last two are remote


@dataclass(frozen=True)
class Decision:
    local: bool
    reason: str  # one of REASONS
    uncached_tokens: int


class PrefillDecider:
    def __init__(self, max_local_prefill_length: int = 256, max_prefill_queue_tokens: int = 4096,
                 local_prefill_decode_requests: int = -1, kv_index: KVIndex | None = None) -> None:
        self.max_local_prefill_length = max_local_prefill_length
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.local_prefill_decode_requests = local_prefill_decode_requests  # -1: never for that reason
        self.cache = CacheView(kv_index)

    def decide(self, request: RoutedRequest, prefill: Instance, decode: Instance) -> Decision:
        block_size = decode.info.block_size or 64
        hashes = request.block_hashes(block_size)
        cached = self.cache.cached_blocks(decode.url, request.lookup_hashes(block_size)) * block_size
        uncached = max(0, request.num_tokens - cached)
        if decode.url in request.slow_local_prefill:  # admission: computed there, its first token would be late
            decision = Decision(False, "slow_locally", uncached)
        elif uncached <= self.max_local_prefill_length:
            decision = Decision(True, "short" if request.num_tokens <= self.max_local_prefill_length else "cached",
                                uncached)
        elif prefill.in_flight_tokens >= self.max_prefill_queue_tokens:
            decision = Decision(True, "prefill_busy", uncached)
        elif decode.in_flight_requests <= self.local_prefill_decode_requests:
            decision = Decision(True, "decode_idle", uncached)
        else:
            decision = Decision(False, "long", uncached)
        self.cache.sent(decode.url, hashes)
        return decision
