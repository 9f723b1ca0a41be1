"""The planner's arithmetic (issue 56): the predictor follows a ramp and counts refused and queued work as load;
the sizing from a profile gives the fewest prefill and decode instances that meet the SLOs, says when none can,
and keeps within the budget; the hysteresis grows a side at once, shrinks it only after two intervals and never
below the headroom's need, does not flap on an edge, and moves an instance between sides only as one is freed."""

from __future__ import annotations

import pytest

from pdserve.planner.predictor import Holt, IntervalLoad, Load, LoadPredictor, MovingAverage
from pdserve.planner.sizing import DeploymentProfile, decode_instances, prefill_instances, size

PROFILE = DeploymentProfile(prefill_tokens_per_s=2000.0, itl_base_s=0.010, itl_per_stream_s=0.002, max_streams=64)


def test_holt_follows_a_ramp_where_a_moving_average_lags():
    holt, average = Holt(alpha=0.5, beta=0.5), MovingAverage(window=3)
    for x in (1, 2, 3, 4, 5, 6):
        holt.observe(x)
        average.observe(x)
    assert holt.predict() == pytest.approx(7, abs=0.3)
    assert average.predict() == pytest.approx(5)
    assert Holt().predict() == 0.0 and MovingAverage().predict() == 0.0


def test_holt_never_predicts_a_negative_load():
    holt = Holt(alpha=0.9, beta=0.9)
    for x in (10, 5, 1, 0):
        holt.observe(x)
    assert holt.predict(steps=3) == 0.0


def test_refused_requests_and_the_queue_count_as_load():
    predictor = LoadPredictor("moving_average")
    predictor.observe(IntervalLoad(seconds=10, requests=20, refused=30, prompt_tokens=20_000, output_tokens=2_000,
                                   queued_prompt_tokens=5_000))
    load = predictor.predict()
    assert load.rate == pytest.approx(5.0)  # 50 wanted in 10 s, though 20 were served
    assert (load.prompt_len, load.output_len, load.backlog_tokens) == (1000, 100, 5000)
    with pytest.raises(ValueError, match="holt or moving_average"):
        LoadPredictor("arima")


def test_prefill_count_grows_with_prompt_tokens_and_the_backlog():
    light = Load(rate=0.5, prompt_len=1000, output_len=100)  # 500 tokens/s of 2,000 one instance computes
    assert prefill_instances(light, PROFILE, ttft_slo_s=1.0, interval_s=30) == (1, "")
    heavy = Load(rate=3.0, prompt_len=1000, output_len=100)  # 3,000 tokens/s
    # a prompt computes in 0.5 s; TTFT 0.5 / (1 - 1.5 / P) <= 1 s needs P >= 3 (P = 2 would wait 2 s)
    assert prefill_instances(heavy, PROFILE, ttft_slo_s=1.0, interval_s=30) == (3, "")
    backlog = Load(rate=0.5, prompt_len=1000, output_len=100, backlog_tokens=60_000)  # 2,000 tokens/s more
    assert prefill_instances(backlog, PROFILE, ttft_slo_s=1.0, interval_s=30)[0] > 1


def test_a_prompt_longer_than_the_ttft_slo_is_said_so():
    p, why = prefill_instances(Load(rate=1.0, prompt_len=4000, output_len=10), PROFILE, ttft_slo_s=1.0,
                               interval_s=30)
    assert p >= 1 and "past the TTFT SLO" in why


def test_decode_count_holds_the_streams_at_the_batch_that_meets_the_tpot_slo():
    load = Load(rate=4.0, prompt_len=50, output_len=300)
    d, why = decode_instances(load, PROFILE, tpot_slo_s=0.050)  # batch 20 per instance: ITL 50 ms
    streams = 4.0 * 300 * 0.050  # 60 in flight
    assert why == "" and d == 4  # 60 / (0.9 * 20) -> 4
    assert decode_instances(Load(rate=0.1, prompt_len=50, output_len=300), PROFILE, tpot_slo_s=0.050)[0] == 1
    assert streams / d <= 20
    slow, why = decode_instances(load, PROFILE, tpot_slo_s=0.005)
    assert "past the TPOT SLO" in why and slow >= 1


def test_the_split_follows_the_phase_and_keeps_within_the_budget():
    long_prompts = size(Load(rate=3.0, prompt_len=1500, output_len=16), PROFILE, ttft_slo_s=2.0, tpot_slo_s=0.05,
                        max_instances=8, interval_s=30)
    long_answers = size(Load(rate=3.0, prompt_len=50, output_len=300), PROFILE, ttft_slo_s=2.0, tpot_slo_s=0.05,
                        max_instances=8, interval_s=30)
    assert long_prompts.prefill > long_prompts.decode and long_answers.decode > long_answers.prefill
    assert long_prompts.meets_slo and long_answers.meets_slo
    cut = size(Load(rate=20.0, prompt_len=1500, output_len=300), PROFILE, ttft_slo_s=2.0, tpot_slo_s=0.05,
               max_instances=4, interval_s=30)
    assert cut.total == 4 and cut.prefill >= 1 and cut.decode >= 1 and not cut.meets_slo
    assert "past --max-instances 4" in cut.reason


def test_a_profile_round_trips_through_its_file(tmp_path):
    PROFILE.save(tmp_path / "profile.json")
    assert DeploymentProfile.load(tmp_path / "profile.json") == PROFILE


def test_a_side_grows_at_once_and_shrinks_only_after_two_intervals_and_never_below_the_headroom():
    from pdserve.planner.hysteresis import Hysteresis
    from pdserve.planner.sizing import Split

    keeper = Hysteresis(max_instances=8, down_after=2)
    current = Split(1, 1)
    current = keeper.step(current, Split(3, 1), Split(3, 1))
    assert (current.prefill, current.decode) == (3, 1)  # a burst: at once
    current = keeper.step(current, Split(1, 1), Split(2, 1))
    assert (current.prefill, current.decode) == (3, 1)  # one quiet interval: nothing given up
    current = keeper.step(current, Split(1, 1), Split(2, 1))
    assert (current.prefill, current.decode) == (2, 1)  # two: down, but not below what the headroom needs


def test_a_load_on_the_edge_does_not_flap():
    from pdserve.planner.hysteresis import Hysteresis
    from pdserve.planner.sizing import Split

    keeper = Hysteresis(max_instances=8, down_after=2)
    current, seen = Split(1, 2), []
    for wanted in (Split(1, 1), Split(1, 2), Split(1, 1), Split(1, 2), Split(1, 1), Split(1, 2)):
        current = keeper.step(current, wanted, Split(1, 2))  # with headroom the load needs 2 D
        seen.append(current.decode)
    assert seen == [2] * 6


def test_within_the_budget_a_growing_side_waits_for_the_other_to_shrink():
    from pdserve.planner.hysteresis import Hysteresis
    from pdserve.planner.sizing import Split

    keeper = Hysteresis(max_instances=3, down_after=1)
    current = keeper.step(Split(1, 2), Split(2, 1), Split(2, 2))  # D cannot shrink: its floor is 2
    assert (current.prefill, current.decode) == (1, 2)
    current = keeper.step(Split(1, 2), Split(2, 1), Split(2, 1))  # now it can: one instance changes role
    assert (current.prefill, current.decode) == (2, 1)


def test_an_interval_counts_answers_where_they_finish_and_the_routers_refusals():
    from pdserve.planner.observe import Snapshot, interval

    def instance(requests: int, prompt: int, output: int, waiting: int) -> str:
        return (f'pdserve_requests_total{{finish_reason="stop"}} {requests - 1}\n'
                f'pdserve_requests_total{{finish_reason="length"}} 1\n'
                f"pdserve_prompt_tokens_total {prompt}\npdserve_generation_tokens_total {output}\n"
                f'pdserve_num_requests_waiting{{dp_rank="0"}} {waiting}\n')

    router = 'pdserve_router_requests_total{status="200"} 40\npdserve_router_requests_total{status="429"} %d\n'
    before = Snapshot.of([router % 2], [("prefill", instance(10, 9_000, 10, 3)),
                                        ("decode", instance(10, 9_000, 900, 0))])
    after = Snapshot.of([router % 7], [("prefill", instance(30, 30_000, 30, 4)),
                                       ("decode", instance(30, 30_000, 3_300, 1))])
    load = interval(before, after, seconds=10)
    # the prefill instance's halves of the PD requests are not answers; its waiting requests are work
    assert (load.requests, load.refused, load.prompt_tokens, load.output_tokens) == (20, 5, 21_000, 2_400)
    assert load.queued_prompt_tokens == 5 * 1050
