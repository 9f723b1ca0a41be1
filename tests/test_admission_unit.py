"""Admission's parts without a server: the load an engine reports, the TTFT/TPOT predicted from it, the
refusals and their Retry-After, and per-key token buckets (with their file read again on change)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from pdserve.admission.load import LoadReport, LoadTracker
from pdserve.admission.predictor import SLO, TPOT_MARGIN, Refusal, judge_tpot, judge_ttft, predict_ttft
from pdserve.admission.rate_limit import RateLimits, client_key
from pdserve.admission.sent import SentSince
from pdserve.admission.step_fit import fit_step_costs, implausible_fit


def report(queued: list[tuple[int, int]], rate: float = 1000.0, step: float = 0.05, cost: float = 0.002,
           waiting: int = 0, at: float | None = None) -> LoadReport:
    return LoadReport(at or time.time(), queued, decoding=4, waiting_streams=waiting, max_num_seqs=64,
                      prefill_rate=rate, step_time=step, decode_cost=cost, next_finish=3.0)


def test_ttft_counts_the_queue_at_the_requests_priority_and_above() -> None:
    r = report([(0, 500), (10, 4000)])
    now = r.time
    assert predict_ttft(r, 500, priority=10, now=now) == pytest.approx(5.0)  # 4,500 ahead + 500 at 1,000/s
    assert predict_ttft(r, 500, priority=0, now=now) == pytest.approx(1.0)  # the priority-10 queue waits
    assert predict_ttft(r, 500, priority=-1, now=now) == pytest.approx(0.5)


def test_ttft_ages_the_report_and_adds_what_was_sent_since() -> None:
    r = report([(0, 2000)])
    assert predict_ttft(r, 0, now=r.time + 1.5) == pytest.approx(0.5)  # 1.5 s drained 1,500 tokens
    assert predict_ttft(r, 0, sent_tokens=300, now=r.time + 3) == pytest.approx(0.3)  # never below what was sent


def test_no_measurement_predicts_nothing_and_refuses_nothing() -> None:
    r = report([(0, 10**6)], rate=0.0, step=0.0)
    assert judge_ttft(SLO(ttft=0.1), r, 1000, 0) == (None, None)
    assert judge_tpot(SLO(tpot=0.001), r) is None


def test_a_ttft_refusal_says_when_the_queue_will_have_drained_enough() -> None:
    r = report([(0, 5000)])
    ttft, refusal = judge_ttft(SLO(ttft=2.0), r, 1000, 0, now=r.time)
    assert ttft == pytest.approx(6.0)
    assert refusal.reason == "ttft_slo" and refusal.error_type == "server_overloaded"
    assert refusal.retry_after == pytest.approx(4.0) and refusal.retry_after_header == "4"
    assert "6000 ms" in refusal.message and "2000 ms" in refusal.message
    assert judge_ttft(SLO(ttft=7.0), r, 1000, 0, now=r.time)[1] is None


def test_tpot_counts_every_stream_that_will_join() -> None:
    r = report([], step=0.05, cost=0.01, waiting=2)
    slo = SLO(tpot=0.085 / TPOT_MARGIN)  # admits up to 85 ms
    assert judge_tpot(slo, r) is None  # 0.05 + 3 x 0.01 = 0.08
    refusal = judge_tpot(slo, r, sent_streams=1)  # 0.09
    assert refusal.reason == "tpot_slo" and refusal.retry_after == pytest.approx(3.0)  # a stream's max_tokens


def test_tpot_from_the_fitted_step_cost_counts_the_prompts_decode_steps_carry() -> None:
    t = LoadTracker(max_num_seqs=64)
    for n, p in ((1, 0), (4, 0), (4, 512), (8, 256), (2, 1024), (8, 0), (6, 128)):
        t.observe(prefill_tokens=p, decodes=n, seconds=0.01 + 0.004 * n + 0.0001 * p)
    base, per_stream, per_token = t.step_costs()
    assert (base, per_stream, per_token) == pytest.approx((0.01, 0.004, 0.0001), rel=1e-6)
    r = t.report({}, decoding=6, waiting_streams=2, min_tokens_left=None)
    expected = 0.01 + 0.004 * (6 + 2 + 1) + 0.0001 * r.prompt_tokens_per_step
    slo = SLO(tpot=(expected + 1e-6) / TPOT_MARGIN)
    assert judge_tpot(slo, r) is None
    assert judge_tpot(slo, r, sent_streams=1) is not None  # one more stream: 4 ms more


def test_a_prefix_is_priced_at_the_rate_of_steps_that_were_mostly_prompt() -> None:
    """What a pull is weighed against: 10,000 prompt tokens/s where a step was mostly prompt, though steps that
    computed a token or two beside 8 decodes average far fewer tokens per second."""
    t = LoadTracker(max_num_seqs=64)
    assert t.prompt_step_rate == 0.0
    for n, p in ((8, 1), (8, 2), (0, 512), (8, 1), (1, 1024), (8, 1)):
        t.observe(prefill_tokens=p, decodes=n, seconds=0.0001 * p + 0.004 * n)
    assert t.prompt_step_rate == pytest.approx(10_000, rel=0.05)
    assert t.prefill_rate < 0.6 * t.prompt_step_rate  # the average over prompt steps counts the decodes


def test_the_running_fit_equals_a_fresh_fit_of_the_steps_it_kept() -> None:
    """The tracker keeps the fit's sums as steps come and go (a report every ~20 ms refits): after thousands of
    steps of changing batch sizes and prompt chunks through a 256-step window, its costs are those of a fit of
    the last 256 steps alone."""
    t = LoadTracker(max_num_seqs=64)
    rng = random.Random(7)
    kept = []
    for i in range(3000):
        streams = rng.choice([1, 2, 4, 8, 16]) if i < 2000 else rng.choice([3, 5])  # the sizes seen change too
        prompt = rng.choice([0, 0, 0, 128, 512])
        seconds = 0.012 + 0.0015 * streams + 0.0004 * prompt + rng.random() * 0.002
        t.observe(prompt, streams, seconds)
        kept = (kept + [(streams, prompt, seconds)])[-LoadTracker.FIT_STEPS:]
    fresh = fit_step_costs(kept)
    assert t.step_costs() == pytest.approx(fresh, rel=1e-6)
    assert fresh[1] == pytest.approx(0.0015, rel=0.2) and fresh[2] == pytest.approx(0.0004, rel=0.2)


def test_the_fit_never_makes_a_cost_negative() -> None:
    """A decode instance under conditional PD that computed two prompts of nearly one length itself (steps
    without streams) and then decoded one stream: unconstrained, the fit put the base at -3.3 s and a stream at
    3.3 s, and `make demo` refused every request after its second. A negative term is left out instead."""
    t = LoadTracker(max_num_seqs=64)
    t.observe(prefill_tokens=285, decodes=0, seconds=0.80)
    t.observe(prefill_tokens=292, decodes=0, seconds=0.90)
    for _ in range(110):
        t.observe(prefill_tokens=0, decodes=1, seconds=0.026)
    base, per_stream, per_token = fit_step_costs(t._steps)
    assert 0 < base < 0.001 and per_stream == pytest.approx(0.026, rel=0.01) and 0.0025 < per_token < 0.0035
    # and a fit without a base is no step's cost: the tracker reports none (the predictions fall back to the rates)
    assert "base is zero" in implausible_fit((base, per_stream, per_token), t._steps)
    assert t.step_costs() == (0.0, 0.0, 0.0)
    r = t.report({}, decoding=1, waiting_streams=0, min_tokens_left=None)
    assert judge_tpot(SLO(tpot=0.1), r) is None


def test_a_calibration_timed_beside_another_is_refused() -> None:
    """Two instances calibrating at once on two cores: the one-stream steps took what four streams take alone, and
    the fit said `step 0.0 ms + 3.45 ms per stream`. Such a fit seeds nothing; a calibration timed alone does."""
    spoiled = [(1, 0, 0.0030), (4, 0, 0.0135), (16, 0, 0.055), (0, 256, 0.36), (0, 1024, 1.44), (4, 256, 0.374)]
    t = LoadTracker(max_num_seqs=16)
    assert "base is zero" in t.calibrate(spoiled)
    assert t.report({}, 0, 0, None).quiet_step_base == 0.0 and t.prefill_rate == 0.0  # admission waits for steps
    alone = [(1, 0, 0.012), (4, 0, 0.015), (16, 0, 0.027), (0, 256, 0.18), (0, 1024, 0.70), (4, 256, 0.19)]
    assert t.calibrate(alone) is None
    base, per_stream, _ = t.step_costs()
    assert base == pytest.approx(0.011, abs=0.002) and per_stream == pytest.approx(0.001, abs=0.0005)
    assert t.prefill_rate == pytest.approx(1024 / 0.70)
    slow_stream = [(1, 0, 0.004), (4, 0, 0.060), (8, 0, 0.100), (16, 0, 0.180)]  # 11 ms a stream; one took 4 ms
    assert "more than a measured one-stream step" in LoadTracker(max_num_seqs=4).calibrate(slow_stream)


def test_a_stream_that_would_decode_alone_is_never_refused_on_tpot() -> None:
    slow = LoadReport(time.time(), [], decoding=0, waiting_streams=0, max_num_seqs=64, prefill_rate=1000.0,
                      step_time=0.2, decode_cost=0.2, next_finish=0.0, step_base=0.2)
    assert judge_tpot(SLO(tpot=0.1), slow) is None  # it slows nobody; refusing it would leave nothing to learn from
    assert judge_tpot(SLO(tpot=0.1), slow, sent_streams=1) is not None  # a second one joins the first


def test_ttft_from_the_fitted_step_cost_pays_each_step_it_waits() -> None:
    t = LoadTracker(max_num_seqs=64, step_tokens=1000)
    for n, p in ((0, 600), (2, 0), (1, 0), (0, 1000), (2, 400), (3, 0)):
        t.observe(prefill_tokens=p, decodes=n, seconds=0.05 + 0.01 * n + 0.0002 * p)
    r = t.report({0: 2500}, decoding=2, waiting_streams=0, min_tokens_left=None)
    # 2,500 ahead + 300: three steps (0.05 + 2 x 0.01 each), then 2,800 tokens at 0.2 ms
    assert predict_ttft(r, 300, now=r.time) == pytest.approx(3 * 0.07 + 0.0002 * 2800, rel=1e-6)


def test_a_step_is_timed_from_its_start_to_the_next_ones_and_waits_are_left_out() -> None:
    t = LoadTracker(max_num_seqs=8)
    t.step_started(10.0)
    t.step_done(prefill_tokens=0, decodes=2, started=10.0)  # its model call ended at 10.03; outputs went out after
    t.step_started(10.05)
    t.step_done(prefill_tokens=0, decodes=3, started=10.05)
    t.cycle_over(10.11)  # the loop waits for work from here
    t.step_started(12.0)  # not part of the last cycle
    assert [s for _, _, s in t._steps] == pytest.approx([0.05, 0.06])
    assert t.report({}, 3, 0, None).step_time == pytest.approx(0.2 * 0.06 + 0.8 * 0.05)


def test_slo_flags() -> None:
    assert not SLO.from_ms(None, 0).enabled  # 0 turns one off (launch's defaults can be undone)
    assert SLO.from_ms(2000, None) == SLO(2.0, None)
    with pytest.raises(ValueError, match="--tpot-slo-ms"):
        SLO.from_ms(100, -5)


def test_tracker_measures_prefill_rate_and_the_cost_of_a_stream() -> None:
    t = LoadTracker(max_num_seqs=8)
    assert t.report({}, 0, 0, None).prefill_rate == 0.0
    t.observe(prefill_tokens=1000, decodes=0, seconds=0.5)
    for n in (1, 2, 4, 8, 4, 2):
        t.observe(prefill_tokens=0, decodes=n, seconds=0.02 + 0.005 * n)
    r = t.report({3: 700, 0: 100}, decoding=2, waiting_streams=1, min_tokens_left=10)
    assert r.prefill_rate == pytest.approx(2000.0)
    assert r.decode_cost == pytest.approx(0.005)
    assert r.queued == [(0, 100), (3, 700)] and r.next_finish == pytest.approx(10 * r.step_time)


def test_sent_since_forgets_what_the_report_includes() -> None:
    sent = SentSince()
    sent.add(100, priority=5, now=10.0)
    sent.add(200, priority=0, now=12.0)
    assert sent.since(11.0) == (200, 1)
    assert sent.since(11.0, priority=-1) == (0, 1)


def _limits(tmp_path: Path, text: str) -> RateLimits:
    path = tmp_path / "limits.yaml"
    path.write_text(text)
    return RateLimits(path)


def test_one_keys_flood_does_not_take_anothers_share(tmp_path: Path) -> None:
    limits = _limits(tmp_path, "default: {requests_per_second: 2, tokens_per_second: 1000}\n")
    refused = [limits.admit("flooder", 10) for _ in range(20)]
    assert sum(r is None for r in refused) == 2  # a second's worth
    first = next(r for r in refused if r is not None)
    assert first.reason == "rate_limit" and first.error_type == "rate_limit_exceeded"
    assert 0 < first.retry_after <= 0.5 + 1e-6
    assert limits.admit("quiet", 10) is None and limits.admit("quiet", 10) is None


def test_tokens_bucket_goes_into_debt_then_refuses_until_refilled(tmp_path: Path) -> None:
    limits = _limits(tmp_path, "keys:\n  k: {tokens_per_second: 100}\n")
    assert limits.admit("k", 250) is None  # a prompt larger than the bucket passes when it is full
    refusal = limits.admit("k", 1)
    assert refusal is not None and refusal.retry_after == pytest.approx(1.5, abs=0.05)  # 150 in debt at 100/s
    assert limits.admit("other", 10**6) is None  # no default: unlisted keys are not limited


def test_generated_tokens_are_charged_at_the_end(tmp_path: Path) -> None:
    limits = _limits(tmp_path, "keys:\n  k: {tokens_per_second: 100}\n")
    assert limits.admit("k", 10) is None
    limits.charge("k", 500)
    assert limits.admit("k", 10) is not None


def test_the_file_is_read_again_when_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limits = _limits(tmp_path, "keys:\n  k: {requests_per_second: 1}\n")
    assert limits.admit("k", 1) is None and limits.admit("k", 1) is not None
    monkeypatch.setattr("pdserve.admission.rate_limit.RELOAD_CHECK_S", 0.0)
    limits.path.write_text("keys:\n  k: {requests_per_second: 50}\n")
    os.utime(limits.path, (time.time() + 5, time.time() + 5))
    assert limits.admit("k", 1) is None  # the new limit, with a full bucket
    limits.path.write_text("keys: [this is not a map\n")
    os.utime(limits.path, (time.time() + 10, time.time() + 10))
    assert limits.admit("k", 1) is None  # a broken file keeps the last good limits


def test_bad_files_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keys.k: unknown field.*requests_per_minute"):
        _limits(tmp_path, "keys:\n  k: {requests_per_minute: 1}\n")
    with pytest.raises(ValueError, match="default.tokens_per_second must be a positive number"):
        _limits(tmp_path, "default: {tokens_per_second: -1}\n")


def test_client_key() -> None:
    assert client_key("Bearer sk-a", "alice", None) == "sk-a"
    assert client_key("Bearer shared", "alice", "shared") == "user:alice"  # the server's one key names nobody
    assert client_key(None, None, None) == "anonymous"


def _fitted(decoding: int = 30) -> LoadReport:
    """A report whose fit predicts a TPOT far above 100 ms for one more stream."""
    return LoadReport(time.time(), [], decoding=decoding, waiting_streams=0, max_num_seqs=64, prefill_rate=2000.0,
                      step_time=0.2, decode_cost=0.005, next_finish=2.0, step_tokens=2048, step_base=0.05,
                      prompt_token_cost=0.0004)


def test_a_request_that_opens_no_stream_is_never_refused_on_tpot() -> None:
    """Prompt scoring and max_tokens 1 (an eval harness's loglikelihood requests) slow no stream."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from pdserve.admission.metrics import AdmissionMetrics
    from pdserve.api.admission import Admitted, ServerAdmission
    from pdserve.router.prompt import PromptReader

    admission = ServerAdmission(SLO(ttft=2.0, tpot=0.1), None, AdmissionMetrics(CollectorRegistry(), "t"), None,
                                SentSince())
    raw = SimpleNamespace(headers={})
    assert isinstance(admission.admit(raw, None, [_fitted()], 20, 0, time.time(), decodes=False), Admitted)
    refused = admission.admit(raw, None, [_fitted()], 20, 0, time.time(), decodes=True)
    assert getattr(refused, "reason", None) == "tpot_slo"
    reader = PromptReader(None)
    assert not reader.read("/v1/completions", {"prompt": "The sky is", "max_tokens": 1}).decodes
    assert not reader.read("/v1/chat/completions", {"messages": [], "max_completion_tokens": 0}).decodes
    scoring = reader.read("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 5})
    assert scoring.single and not scoring.decodes
    assert reader.read("/v1/completions", {"prompt": "The sky is", "max_tokens": 2}).decodes
    assert reader.read("/v1/completions", {"prompt": "The sky is"}).decodes


def test_calibration_steps_fit_the_empty_cache_and_the_step_budget() -> None:
    from pdserve.admission.calibration import CONTEXT, calibration_plan

    plan = calibration_plan(64, 2048, 400, 16, 4096)
    streams = {s.decodes for s in plan if not s.prompt_tokens}
    chunks = {s.prompt_tokens for s in plan if not s.decodes}
    assert streams == {1, 4, 16} and chunks == {256, 1024}  # 64 streams of 256 tokens need 1,024 blocks: left out
    assert any(s.decodes and s.prompt_tokens for s in plan)  # a step that carries both
    assert all(s.decodes * CONTEXT // 16 + -(-s.prompt_tokens // 16) <= 400 for s in plan)
    assert {s.prompt_tokens for s in calibration_plan(4, 64, 200, 16, 512) if not s.decodes} == {16, 64}
    assert calibration_plan(64, 2048, 1, 16, 4096) == []


def test_a_calibrated_tracker_judges_the_first_burst() -> None:
    """Seeded before any request, the fit refuses what a burst would push past the TTFT objective."""
    tracker = LoadTracker(64, 2048)
    assert tracker.report({}, 0, 0, None).prefill_rate == 0  # uncalibrated: nothing to judge with
    tracker.calibrate([(1, 0, 0.020), (4, 0, 0.026), (16, 0, 0.050), (0, 256, 0.11), (0, 1024, 0.40),
                       (4, 256, 0.13)])
    fresh = tracker.report({}, 0, 0, None)
    assert fresh.step_base > 0 and fresh.decode_cost > 0 and fresh.prompt_token_cost > 0
    assert fresh.prefill_rate == pytest.approx(1024 / 0.40)
    assert (fresh.quiet_step_base, fresh.quiet_decode_cost) == (fresh.step_base, fresh.decode_cost)  # the floor's
    assert judge_ttft(SLO(ttft=2.0), fresh, 600, 0)[1] is None  # the burst's first is admitted
    ttft, refusal = judge_ttft(SLO(ttft=2.0), fresh, 600, 0, sent_tokens=600 * 10)  # its eleventh is not
    assert refusal is not None and ttft > 2.0


def test_a_served_report_counts_what_the_server_handed_its_engine_since() -> None:
    """A request on its way to the engine is in no engine report yet: /load folds it in."""
    r = report([(0, 100)])
    sent = SentSince()
    sent.add(500, 0, now=r.time - 1)  # before the report: in it
    sent.add(300, 0, now=r.time + 0.01)
    sent.add(200, 10, now=r.time + 0.02)
    sent.add(0, 0, now=r.time + 0.03)  # a PD decode side: a stream, no prompt to compute
    served = sent.fold_into(r, acked=7)
    assert served.queued == [(0, 400), (10, 200)] and served.waiting_streams == r.waiting_streams + 3
    assert served.time == r.time and served.acked == 7


def test_a_router_forgets_what_an_instance_acknowledged_not_what_it_sent_before_a_poll() -> None:
    """Requests still in the instance's API server when the poll started are counted until it has them."""
    from pdserve.http.wire import parse_sent

    sent = SentSince()
    for seq, tokens in ((1, 600), (2, 600), (3, 600)):
        sent.add(tokens, 0, now=100.0, seq=seq)
    sent.acknowledge(1)
    assert sent.since(0.0) == (1200, 2)  # 2 and 3 were sent before any poll, and are not taken yet
    sent.acknowledge(3)
    assert sent.since(0.0) == (0, 0)
    assert parse_sent("4f2a:17") == ("4f2a", 17) and parse_sent("nonsense") is None and parse_sent(None) is None


def _neighboured(decoding: int, quiet: bool = True) -> LoadReport:
    """Live steps four times slower than the calibration measured alone (a neighbour came): the live fit refuses
    on both SLOs; the calibration says 5 prompts of 600 tokens fit in half of 2 s, 40 streams in half of 100 ms."""
    return LoadReport(time.time(), [(0, 600)], decoding=decoding, waiting_streams=1, max_num_seqs=64,
                      prefill_rate=600.0, step_time=0.2, decode_cost=0.004, next_finish=2.0, step_tokens=2048,
                      step_base=0.1, prompt_token_cost=0.0016, decodes_per_step=float(decoding),
                      quiet_step_base=0.01 if quiet else 0.0, quiet_decode_cost=0.001, quiet_prefill_rate=3000.0)


def test_the_floor_is_what_the_calibration_serves_within_half_of_each_slo() -> None:
    from pdserve.admission.floor import in_flight_floor

    slo = SLO(ttft=2.0, tpot=0.1)
    assert in_flight_floor(slo, _neighboured(2), 600, decodes=True) == 5  # 0.5 x 2 s x 3,000 tokens/s / 600
    assert in_flight_floor(slo, _neighboured(2), None, decodes=True) == 40  # (50 - 10 ms) / 1 ms: a decode instance
    assert in_flight_floor(slo, _neighboured(2), 600, decodes=False) == 5  # a prefill instance
    assert in_flight_floor(SLO(tpot=0.1), _neighboured(2), 600, decodes=False) == 64  # no SLO binds: max_num_seqs
    assert in_flight_floor(slo, _neighboured(2, quiet=False), 600, decodes=True) == 0  # not calibrated: no floor


def test_an_instance_below_its_floor_is_never_refused() -> None:
    """A few requests on a slowed instance are admitted; past the floor, the live prediction refuses."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from pdserve.admission.metrics import AdmissionMetrics
    from pdserve.api.admission import Admitted, ServerAdmission

    admission = ServerAdmission(SLO(ttft=2.0, tpot=0.1), None, AdmissionMetrics(CollectorRegistry(), "t"), None,
                                SentSince())
    raw = SimpleNamespace(headers={})
    assert judge_tpot(admission.slo, _neighboured(3)) is not None  # the live prediction alone would refuse
    assert isinstance(admission.admit(raw, None, [_neighboured(3)], 600, 0, time.time()), Admitted)  # 5th of 5
    assert isinstance(admission.admit(raw, None, [_neighboured(4)], 600, 0, time.time()), Refusal)  # the 6th
    assert isinstance(admission.admit(raw, None, [_neighboured(1, quiet=False)], 600, 0, time.time()), Refusal)


def test_ttft_predictions_are_corrected_by_their_recent_error() -> None:
    from pdserve.admission.correction import Correction

    correction = Correction()
    for _ in range(4):
        correction.observe(1.0, 1.6)
    assert correction.factor == 1.0  # too few to go by
    correction.observe(1.0, 1.6)
    assert correction.factor == pytest.approx(1.6)
    for _ in range(100):
        correction.observe(0.1, 5.0)
    assert correction.factor == pytest.approx(2.0, abs=1e-3)  # never more than doubled
    r = report([(0, 1000)])
    assert judge_ttft(SLO(ttft=2.0), r, 500, 0, now=r.time)[1] is None  # 1.5 s predicted
    ttft, refusal = judge_ttft(SLO(ttft=2.0), r, 500, 0, now=r.time, correction=1.6)
    assert ttft == pytest.approx(1.5) and refusal is not None  # the uncorrected one is what is measured against
    assert "2400 ms" in refusal.message and refusal.retry_after == pytest.approx(0.4)


def test_tpot_is_corrected_by_how_far_the_steps_lately_ran_from_the_fit() -> None:
    """Steps lately twice what the fit says of them: one more stream is judged at twice the fit's TPOT."""
    tracker = LoadTracker(64, 2048)
    for n in (2, 4, 8, 4, 2, 8) * 50:  # the fit's 256 steps and more
        tracker.observe(0, n, 0.01 + 0.002 * n)
    fitted = tracker.report({}, 8, 0, None)
    assert fitted.tpot_error == pytest.approx(1.0, rel=0.05)
    assert 2 < fitted.decodes_per_step < 8
    assert judge_tpot(SLO(tpot=0.04), fitted) is None  # 10 + 9 x 2 = 28 ms, within 0.9 x 40
    for _ in range(10):
        tracker.observe(0, 8, 2 * (0.01 + 0.002 * 8))  # a neighbour came
    slowed = tracker.report({}, 8, 0, None)
    assert slowed.tpot_error > 1.4
    assert judge_tpot(SLO(tpot=0.04), slowed) is not None


def test_a_server_counts_the_prompt_tokens_its_engine_will_compute() -> None:
    """A burst on one prefix is judged as one prefix and many tails (the engine finds the blocks handed over
    before cached); an adapter's blocks are its own; without prefix caching every prompt counts whole."""
    from pdserve.api.prompt_work import PromptWork

    work = PromptWork(block_size=16, num_blocks=100)
    prefix = list(range(1000, 1064))  # 4 blocks
    first, second = prefix + [1, 2, 3], prefix + [4, 5, 6]
    assert work.tokens(first) == 67
    work.handed_over(first)
    assert work.tokens(second) == 3
    assert work.tokens(second, lora="sql") == 67  # another adapter's KV differs
    assert work.tokens(prefix) == 16  # a prompt of whole blocks computes its last block: its logits are needed
    assert work.tokens(list(range(2000, 2067))) == 67
    off = PromptWork(block_size=16, num_blocks=100, prefix_caching=False)
    off.handed_over(first)
    assert off.tokens(second) == 67
