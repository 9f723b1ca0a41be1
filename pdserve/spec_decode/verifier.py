"""The worker's half of speculation: one sampling row per scored position, then acceptance.

A speculating sequence's chunk is its last token plus K proposed tokens; the forward pass gives logits
at all 1 + K positions. Position j is sampled as plain decoding would sample it after the proposals
before it (penalties, min_tokens and the grammar mask see them; a seeded sequence uses the uniform
number of its (n + j)-th output token). The proposal at j is accepted when the token drawn there equals
it; the first position that differs gives its drawn token instead, and later positions are dropped.

This is rejection sampling for a proposal that puts all its mass on one token q: accepting q with
probability p(q) and otherwise drawing from p without q (normalised) is the law of "draw x ~ p, accept
if x == q", so the output distribution is the target's, and greedy speculation is token for token plain
greedy. Drawing with the position's own uniform keeps one uniform per output token, so a seeded answer
is the same with or without speculation (and a decode instance or a resumed answer skips draws as
before).
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.sampling import SamplingRow, skip_draws


def position_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The sampling rows of positions 0 .. len(drafts): position j has seen drafts[:j] as output."""
    return [row] + [dataclasses.replace(row, output_token_ids=row.output_token_ids + drafts[:j])
                    for j in range(1, len(drafts) + 1)]


def accepted_tokens(drawn: list[int], drafts: list[int]) -> list[int]:
    """The tokens a sequence emits: the drawn tokens up to and including the first one that differs from
    its proposal (all 1 + K when every proposal holds)."""
    n = 0
    while n < len(drafts) and drawn[n] == drafts[n]:
        n += 1
    return drawn[:n + 1]


def rewind(generator: torch.Generator, state: torch.Tensor, num_emitted: int) -> None:
    """A seeded sequence drew 1 + K uniforms from `state` to score its positions but spends one per
    emitted token: its generator goes where plain decoding would have it."""
    generator.set_state(state)
    skip_draws(generator, num_emitted)
