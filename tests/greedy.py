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

from collections.abc import Callable, Iterable, Sequence

import torch

from pdserve.model.load import resolve_dtype

DEFAULT_IS_BF16 = resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
NEAR_TIE = 0.26 if DEFAULT_IS_BF16 else 1e-3
HTTP_NEAR_TIE = 0.26 if DEFAULT_IS_BF16 else 0.02  # two servers batch differently


MIN_COMPARED = 4  # tokens a comparison must cover before a near tie ends it (fewer when the output is shorter)


def compare_greedy(ref: Sequence, got: Sequence, margin_at: Callable[[int], float], near_tie: float, what: str,
                   min_compared: int = MIN_COMPARED) -> int:
    """Equal token for token up to the first difference, which must be a near tie of the reference
    (`margin_at(i)`: its top-two log-probability gap at token i); returns how many tokens were compared.
    A comparison that covered fewer than `min_compared` tokens (or the whole output, if shorter, but at least
    one) fails: a near tie that early, or an empty answer, shows nothing. min_compared=0 is for callers that
    require a share of many comparisons instead (assert_same_greedy_completions)."""
    compared = len(ref)
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            margin = margin_at(i)
            assert margin < near_tie, (f"{what}: token {i} differs ({b!r} vs reference {a!r}) where the reference's "
                                       f"top two differ by {margin:.4f}, not a near tie\nout:       {list(got)}\n"
                                       f"reference: {list(ref)}")
            compared = i
            break
    else:
        assert len(ref) == len(got), f"{what}: {len(got)} vs {len(ref)} tokens in the reference"
    needed = max(1, min(min_compared, len(ref))) if min_compared else 0
    assert compared >= needed, (f"{what}: only {compared} tokens compared before a near tie (at least {needed}): "
                                f"choose a prompt whose greedy answer has no near tie so early")
    return compared


def top_two_gap(logprobs: Iterable[float]) -> float:
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def assert_same_greedy(reference, other, min_compared: int = MIN_COMPARED) -> int:  # noqa: ANN001 (CompletionOutput)
    """Two offline CompletionOutputs (the reference asked with logprobs=2, for its margins)."""

    def margin_at(i: int) -> float:
        assert reference.logprobs is not None, f"outputs differ at token {i} and the reference has no logprobs"
        return top_two_gap(lp.logprob for lp in reference.logprobs[i].values())

    return compare_greedy(reference.token_ids, other.token_ids, margin_at, NEAR_TIE, "greedy output", min_compared)


def assert_same_greedy_completion(out, reference, what: str, min_compared: int = MIN_COMPARED) -> int:  # noqa: ANN001
    """The same for two HTTP completions asked with logprobs=2 (openai Completion objects), with a looser
    tie (HTTP_NEAR_TIE); returns how many tokens were compared before the first (tied) difference."""
    a, b = out.choices[0].logprobs, reference.choices[0].logprobs
    return compare_greedy(b.tokens, a.tokens, lambda i: top_two_gap(b.top_logprobs[i].values()), HTTP_NEAR_TIE,
                          what, min_compared)


def assert_same_greedy_completions(outs: list, references: list, min_share: float) -> int:
    """Many HTTP completions against their references: each equal up to a near tie, which may come at any
    token of a single answer (prompts cut from a text at random), and together at least `min_share` of the
    reference tokens compared. Returns the tokens compared."""
    compared = sum(assert_same_greedy_completion(a, b, f"prompt {i}", min_compared=0)
                   for i, (a, b) in enumerate(zip(outs, references, strict=True)))
    total = sum(len(r.choices[0].logprobs.tokens) for r in references)
    assert total and compared >= min_share * total, f"only {compared} of {total} tokens matched before near ties"
    return compared
