"""The opt-in int8 path (--quantization w8a8): not exact, but it must stay close to fp32."""

from __future__ import annotations

import pytest

from pdserve.model import SequenceChunk
from pdserve.model_runner import ModelRunner

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

PROMPTS = ["Explain in a few sentences why the sky is blue.", "Write a short poem about the ocean."]
STEPS = 48


@pytest.fixture(scope="module")
def int8_runner():
    return ModelRunner(None, dtype="float32", device="cpu", quantization="w8a8")


def _greedy(runner, ids: list[int]) -> list[int]:
    runner.allocate_kv_cache(8)
    table = list(range(8))
    out = [int(runner.logits([SequenceChunk(ids, 0, table)]).argmax())]
    for i in range(STEPS - 1):
        out.append(int(runner.logits([SequenceChunk([out[-1]], len(ids) + i, table)]).argmax()))
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_int8_follows_fp32_closely(prompt, embedded_runner, int8_runner, embedded_tokenizer):
    ids = embedded_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    reference = _greedy(embedded_runner, ids)
    # Teacher forcing: feed the fp32 continuation, count where int8 picks the same next token.
    int8_runner.allocate_kv_cache(8)
    table = list(range(8))
    sequence = ids + reference
    int8_runner.logits([SequenceChunk(ids[:-1], 0, table)])
    agree = 0
    for i in range(STEPS):
        pos = len(ids) - 1 + i
        agree += int(int8_runner.logits([SequenceChunk([sequence[pos]], pos, table)]).argmax()) == reference[i]
    assert agree >= 0.8 * STEPS, f"int8 agreed with fp32 on only {agree}/{STEPS} next tokens"


def test_int8_frees_the_fp32_matrices(int8_runner, embedded_runner):
    for layer in int8_runner.model.layers:  # qkv, o, gate_up now live only as int8 copies
        assert layer.qkv.numel() == layer.o.numel() == layer.gate_up.numel() == 0
    layer = embedded_runner.model.layers[0]
    fp32_matrices = sum(lin.nbytes for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj))
    saved = embedded_runner.model.weight_bytes() - int8_runner.model.weight_bytes()
    assert saved >= 0.75 * fp32_matrices * len(int8_runner.model.layers)  # fp32 -> int8: 3 of 4 bytes go
