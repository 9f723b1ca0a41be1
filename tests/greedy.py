"""Comparing greedy outputs of two runs that may differ in float rounding (batch shapes, chunking).

Exact equality is demanded except at a genuine near-tie: where the runs diverge, the reference's
top-two log-probabilities must be within NEAR_TIE of each other, and the rest is not compared.
"""

from __future__ import annotations

NEAR_TIE = 1e-3


def assert_same_greedy(reference, other) -> None:  # noqa: ANN001 (pdserve CompletionOutput)
    ref, got = reference.token_ids, other.token_ids
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a == b:
            continue
        assert reference.logprobs is not None, f"outputs differ at token {i} ({a} vs {b})"
        top = sorted((lp.logprob for lp in reference.logprobs[i].values()), reverse=True)
        margin = top[0] - top[1]
        assert margin < NEAR_TIE, f"outputs differ at token {i} ({a} vs {b}) where the margin is {margin:.4f}"
        return
    assert len(ref) == len(got), f"lengths differ: {len(ref)} vs {len(got)}"
