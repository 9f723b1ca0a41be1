"""Incremental detokenization: token-by-token deltas add up to the full decode, stop strings never leak."""

from __future__ import annotations

import pytest

from pdserve.sampling import SamplingParams
from pdserve.tokenization.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world! Unicode: naïve café, 日本語, emoji 🚀🔥 <|im_end|> end.", "a\n\nb  c 12345\tx"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_deltas_add_up_to_the_full_decode(embedded_tokenizer, text, skip_special):
    ids = embedded_tokenizer.encode(text) + [2, 5]
    detok = IncrementalDetokenizer(embedded_tokenizer, SamplingParams(skip_special_tokens=skip_special))
    deltas = [detok.add([i]) for i in ids]
    out = "".join(deltas) + detok.finish()
    assert out == embedded_tokenizer.decode(ids, skip_special_tokens=skip_special) == detok.text
    assert not any("\ufffd" in d for d in deltas), "half a multi-byte character was emitted"


@pytest.mark.parametrize("stop", ["日本", "world", "🔥"])
def test_stop_string_is_cut_and_never_emitted(embedded_tokenizer, stop):
    ids = embedded_tokenizer.encode(TEXTS[0])
    detok = IncrementalDetokenizer(embedded_tokenizer, SamplingParams(stop=[stop, "never there"]))
    deltas = []
    for i in ids:
        deltas.append(detok.add([i]))
        if detok.stopped:
            break
    full = embedded_tokenizer.decode(ids)
    assert detok.stopped and "".join(deltas) == detok.text == full[:full.index(stop)]


@pytest.mark.parametrize("stop", ["日本", "world", "🔥"])
def test_tokens_that_arrive_together_end_at_the_stop_as_single_ones_do(embedded_tokenizer, stop):
    """Speculative decoding hands the detokenizer several tokens at once: the answer keeps those up to
    the one that completed the stop string (num_used), as when they come one by one."""
    ids = embedded_tokenizer.encode(TEXTS[0])
    single = IncrementalDetokenizer(embedded_tokenizer, SamplingParams(stop=[stop]))
    kept = 0
    while not single.stopped:
        single.add([ids[kept]])
        kept += 1
    grouped = IncrementalDetokenizer(embedded_tokenizer, SamplingParams(stop=[stop]))
    used, deltas = 0, []
    for start in range(0, len(ids), 5):
        deltas.append(grouped.add(ids[start:start + 5]))
        used += grouped.num_used
        if grouped.stopped:
            break
    assert used == kept and "".join(deltas) == grouped.text == single.text
