"""Comparing two ModelRunners of one model that compute differently (quantized weights, an 8-bit KV cache): the
reference's greedy answer with its top-two margins, and where the reference is sure, whether the other agrees."""

from __future__ import annotations

from pdserve.model import SequenceChunk

SURE = 1.0  # a logit between the reference's top two


def greedy(runner, ids: list[int], steps: int) -> tuple[list[int], list[float]]:  # noqa: ANN001 (ModelRunner)
    """Greedy tokens of a free run after `ids`, and the top-two logit gap at each."""
    runner.allocate_kv_cache(8)
    table = list(range(8))
    tokens, margins = [], []
    logits = runner.logits([SequenceChunk(ids, 0, table)])
    for i in range(steps):
        top = logits[0].topk(2).values
        tokens.append(int(logits[0].argmax()))
        margins.append(float(top[0] - top[1]))
        logits = runner.logits([SequenceChunk([tokens[-1]], len(ids) + i, table)])
    return tokens, margins


def agreement_where_sure(reference, runner, ids: list[int], steps: int) -> list[bool]:  # noqa: ANN001
    """Teacher-forced on the reference's greedy answer: at each step where the reference's top two are SURE or more
    apart, whether the runner's next token is the reference's."""
    answer, margins = greedy(reference, ids, steps)
    runner.allocate_kv_cache(8)
    table, sequence = list(range(8)), ids + answer
    agrees = []
    logits = runner.logits([SequenceChunk(ids, 0, table)])
    for i in range(steps):
        agrees.append(int(logits[0].argmax()) == answer[i])
        logits = runner.logits([SequenceChunk([sequence[len(ids) + i]], len(ids) + i, table)])
    return [ok for ok, margin in zip(agrees, margins, strict=True) if margin >= SURE]
