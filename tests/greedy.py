"""Comparing greedy outputs of two runs that may differ in float rounding (batch shapes, chunking,
or two deployments: PD against mixed).

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


def assert_same_greedy_completion(out, reference, what: str) -> int:  # noqa: ANN001 - openai Completion objects
    """The same for two HTTP completions asked with logprobs=2, with a looser tie (0.02: two servers
    batch differently); returns how many tokens were compared before the first (tied) difference."""
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
