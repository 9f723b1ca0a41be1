"""The greedy comparison every correctness test relies on cannot pass having compared (almost) nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.greedy import MIN_COMPARED, assert_same_greedy_completions, compare_greedy

TIE, CLEAR = 0.0, 5.0  # the reference's top-two gap at a difference


def test_equal_outputs_count_every_token() -> None:
    assert compare_greedy([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], lambda i: CLEAR, 0.1, "same") == 5


def test_a_late_near_tie_ends_the_comparison_there() -> None:
    assert compare_greedy([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9], lambda i: TIE, 0.1, "tie") == 5


@pytest.mark.parametrize("ref,got,gap", [
    ([1, 2, 3, 4, 5], [1, 9, 3, 4, 5], TIE),  # a near tie at token 1: one token compared
    ([], [], TIE),  # nothing to compare
    ([1, 2, 3], [1, 2, 3, 4], TIE),  # lengths differ without a difference
    ([1, 2, 3, 4, 5], [1, 2, 3, 4, 9], CLEAR),  # a real difference
])
def test_too_little_or_a_real_difference_fails(ref: list[int], got: list[int], gap: float) -> None:
    with pytest.raises(AssertionError):
        compare_greedy(ref, got, lambda i: gap, 0.1, "case")


def test_the_minimum_is_the_whole_output_when_it_is_shorter() -> None:
    assert MIN_COMPARED > 2
    assert compare_greedy([1, 2], [1, 2], lambda i: CLEAR, 0.1, "short") == 2
    with pytest.raises(AssertionError):
        compare_greedy([1, 2], [1, 9], lambda i: TIE, 0.1, "short, tied at once")


def _completion(tokens: list[str], gap: float) -> SimpleNamespace:
    """An openai Completion as the helper reads it: tokens and their top-two logprobs."""
    logprobs = SimpleNamespace(tokens=tokens, top_logprobs=[{"a": 0.0, "b": -gap} for _ in tokens])
    return SimpleNamespace(choices=[SimpleNamespace(logprobs=logprobs)])


def test_many_completions_need_a_share_of_their_tokens_compared() -> None:
    same = [_completion(list("abcdefgh"), TIE) for _ in range(4)]
    early_tie = _completion(list("xbcdefgh"), TIE)  # ties at once: fine alone, not for all of them
    assert assert_same_greedy_completions([*same[:3], early_tie], same, min_share=0.7) == 24
    with pytest.raises(AssertionError):
        assert_same_greedy_completions([early_tie] * 4, same, min_share=0.7)
