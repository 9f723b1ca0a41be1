"""Comparing greedy completions of two deployments that batch differently (so round floats differently)."""

from __future__ import annotations


def assert_same_greedy(out, reference, what: str) -> int:  # noqa: ANN001 - openai Completion objects
    """Tokens must agree until the first near tie (top two within 0.02) of the reference run; returns
    how many were compared. Both must have been asked with logprobs=2."""
    a, b = out.choices[0].logprobs, reference.choices[0].logprobs
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)):
        if x != y:
            top = sorted(b.top_logprobs[i].values(), reverse=True)
            margin = top[0] - top[1] if len(top) > 1 else float("inf")
            assert margin < 0.02, (f"{what}: token {i} differs ({x!r} vs reference {y!r}) where the reference's "
                                   f"top two differ by {margin:.4f}, not a near tie\nout:       {a.tokens}\n"
                                   f"reference: {b.tokens}")
            return i
    assert len(a.tokens) == len(b.tokens), f"{what}: {len(a.tokens)} vs {len(b.tokens)} tokens"
    return len(a.tokens)
