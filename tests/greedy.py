"""Comparing greedy outputs of two runs that may differ in float rounding (batch shapes, chunking,
or two deployments: PD against mixed).

Exact equality is demanded except at a genuine near-tie: where the runs diverge, the reference's
top-two log-probabilities must be within NEAR_TIE of each other, and the rest is not compared.

The tie depends on the dtype the engine runs by default on this machine. In fp32 two batch shapes
change only the last bits (NEAR_TIE 1e-3). In bf16 (the default where the CPU has bf16 dot products)
this model's top logits (16-32) are bf16 numbers 0.125 apart, and a different batch shape can round
an activation the other way, so tokens one or two such steps apart may swap (seen: margins of 0.125).
"""

from __future__ import annotations

import torch

from pdserve.model.load import resolve_dtype

DEFAULT_IS_BF16 = resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
NEAR_TIE = 0.26 if DEFAULT_IS_BF16 else 1e-3
HTTP_NEAR_TIE = 0.26 if DEFAULT_IS_BF16 else 0.02  # two servers batch differently


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
    """The same for two HTTP completions asked with logprobs=2, with a looser tie (HTTP_NEAR_TIE); returns
    how many tokens were compared before the first (tied) difference."""
    a, b = out.choices[0].logprobs, reference.choices[0].logprobs
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)):
        if x != y:
            top = sorted(b.top_logprobs[i].values(), reverse=True)
            margin = top[0] - top[1] if len(top) > 1 else float("inf")
            assert margin < HTTP_NEAR_TIE, (
                f"{what}: token {i} differs ({x!r} vs reference {y!r}) where the reference's top two differ by "
                f"{margin:.4f}, not a near tie\nout:       {a.tokens}\nreference: {b.tokens}")
            return i
    assert len(a.tokens) == len(b.tokens), f"{what}: {len(a.tokens)} vs {len(b.tokens)} tokens"
    return len(a.tokens)
