"""Counters of proposals and acceptances, vLLM's spec_decode metrics (engine-side, torch-free)."""

from __future__ import annotations

import msgspec


class SpecDecodeCounts(msgspec.Struct):
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    rates: dict[str, float]  # tokens/s per batch bucket, with and without speculation ("spec_b4": 4-7 sequences)


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # sequence-steps that carried proposals
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens  # proposals accepted at position 0, 1, ...

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def counts(self, rates: dict[str, float]) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                list(self.accepted_per_pos), rates)
