"""Counters of proposals and acceptances, vLLM's spec_decode metrics (engine-side, torch-free)."""

from __future__ import annotations


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

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
