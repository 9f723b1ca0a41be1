"""The planner's arithmetic (issue 56): the predictor follows a ramp and counts refused and queued work as load;
the sizing from a profile gives the fewest prefill and decode instances that meet the SLOs, says when none can,
and keeps within the budget; the hysteresis grows a side at once, shrinks it only after two intervals and never
below the headroom's need, does not flap on an edge, and moves an instance between sides only as one is freed."""

from __future__ import annotations

import pytest

from pdserve.planner.predictor import Holt, IntervalLoad, Load, LoadPredictor, MovingAverage
from pdserve.planner.roles import RoleCounts, RolePlanner, best_roles, changes
from pdserve.planner.sizing import DeploymentProfile, Needs, decode_instances, needs, prefill_instances

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


def test_the_needs_follow_the_phase():
    long_prompts = needs(Load(rate=3.0, prompt_len=1500, output_len=16), PROFILE, ttft_slo_s=2.0, tpot_slo_s=0.05,
                         interval_s=30)
    long_answers = needs(Load(rate=3.0, prompt_len=50, output_len=300), PROFILE, ttft_slo_s=2.0, tpot_slo_s=0.05,
                         interval_s=30)
    assert long_prompts.prefill > 1 > long_prompts.decode and long_answers.decode > 1 > long_answers.prefill
    assert long_prompts.reason == long_answers.reason == ""


def test_a_profile_round_trips_through_its_file(tmp_path):
    PROFILE.save(tmp_path / "profile.json")
    assert DeploymentProfile.load(tmp_path / "profile.json") == PROFILE


PD = RoleCounts(1, 1)


def test_two_instances_lend_the_busy_side_a_mixed_one_and_keep_pure_roles_when_they_suffice():
    assert best_roles(Needs(1.6, 0.2), PD) == RoleCounts(1, 0, 1)  # long prompts: D -> mixed
    assert best_roles(Needs(0.1, 1.5), PD) == RoleCounts(0, 1, 1)  # long answers: P -> mixed
    assert best_roles(Needs(0.3, 0.3), RoleCounts(1, 0, 1)) == PD  # light: back to pure roles
    assert best_roles(Needs(0.0, 0.0), RoleCounts(1, 3)) == RoleCounts(1, 3)  # idle: nothing moves
    assert best_roles(Needs(2.5, 0.5), RoleCounts(1, 3)) == RoleCounts(3, 1)
    assert best_roles(Needs(9.0, 1.0), PD) == RoleCounts(1, 0, 1)  # past any split: the least pressure
    assert RoleCounts(1, 0, 1).pressure(Needs(1.6, 0.2)) == pytest.approx(0.9)


def test_a_burst_moves_at_once_and_a_fitting_change_waits_to_settle():
    planner = RolePlanner(settle=2, headroom=0.2)
    burst = planner.step(PD, Needs(1.6, 0.2))  # 1P misses the TTFT SLO: at once
    assert burst.move and burst.target == RoleCounts(1, 0, 1) and "misses" in burst.reason
    light = Needs(0.3, 0.3)
    first = planner.step(RoleCounts(1, 0, 1), light)
    assert not first.move and "1 of 2" in first.reason
    second = planner.step(RoleCounts(1, 0, 1), light)
    assert second.move and second.target == PD


def test_a_load_on_the_edge_does_not_flap_and_survivors_must_absorb_the_headroom():
    planner = RolePlanner(settle=2, headroom=0.2)
    current = RoleCounts(1, 0, 1)
    for need in (Needs(0.9, 0.2), Needs(1.05, 0.2)) * 3:  # PD fits the first, not the second
        decision = planner.step(current, need)
        assert not decision.move, decision.reason
    tight = Needs(0.9, 0.2)  # PD fits it, but not with 20% more
    planner.step(current, tight)
    held = planner.step(current, tight)
    assert not held.move and "headroom" in held.reason


def test_the_least_busy_instances_change_role():
    roles = {"a": "prefill", "b": "decode", "c": "decode", "d": "decode"}
    assert changes(roles, RoleCounts(2, 2), {"b": 5, "c": 0, "d": 2}) == [("c", "prefill")]
    assert changes(roles, RoleCounts(1, 2, 1), {"b": 5, "c": 7, "d": 2}) == [("d", "mixed")]
    assert changes(roles, RoleCounts(1, 3), {}) == []


def test_an_interval_counts_answers_where_they_finish_and_the_routers_refusals():
    from pdserve.planner.observe import Snapshot, interval

    def instance(requests: int, prompt: int, output: int, waiting: int) -> str:
        return (f'pdserve_requests_total{{finish_reason="stop"}} {requests - 1}\n'
                f'pdserve_requests_total{{finish_reason="length"}} 1\n'
                f"pdserve_prompt_tokens_total {prompt}\npdserve_generation_tokens_total {output}\n"
                f'pdserve_num_requests_waiting{{dp_rank="0"}} {waiting}\n')

    router = 'pdserve_router_requests_total{status="200"} 40\npdserve_router_requests_total{status="429"} %d\n'
    before = Snapshot.of([router % 2], {"p": ("prefill", instance(10, 9_000, 10, 3)),
                                        "d": ("decode", instance(10, 9_000, 900, 0))})
    after = Snapshot.of([router % 7], {"p": ("prefill", instance(30, 30_000, 30, 4)),
                                       "d": ("decode", instance(30, 30_000, 3_300, 1))})
    load = interval(before, after, seconds=10)
    # the prefill instance's halves of the PD requests are not answers; its waiting requests are work
    assert (load.requests, load.refused, load.prompt_tokens, load.output_tokens) == (20, 5, 21_000, 2_400)
    assert load.queued_prompt_tokens == 5 * 1050
    # the prefill instance became mixed: only what it answered since counts, not its prefill halves before
    switched = Snapshot.of([router % 7], {"p": ("mixed", instance(32, 31_000, 100, 0)),
                                          "d": ("decode", instance(30, 30_000, 3_300, 0))})
    assert interval(after, switched, seconds=10).requests == 2


def test_the_profile_is_corrected_by_the_latencies_the_deployment_shows():
    from pdserve.planner.correction import Correction

    correction = Correction(smoothing=1.0)
    # 1,000-token prompts at 1 req/s on one instance: at the profile's 2,000 tokens/s the TTFT would be
    # 0.5 / (1 - 0.5) = 1 s; 3 s observed is what a 1,000 / 3 + 1,000 = 1,333 tokens/s instance shows
    seen = IntervalLoad(10, 10, 0, 10_000, 1_000, mean_ttft_s=3.0, mean_tpot_s=0.060, decoding_streams=20)
    correction.observe(seen, PROFILE, prefill_capacity=1, decode_capacity=1)
    assert correction.prefill == pytest.approx(2000 / (1000 / 3 + 1000))
    assert correction.decode == pytest.approx(0.060 / PROFILE.itl(20))
    slower = correction.applied(PROFILE)
    assert slower.prefill_tokens_per_s == pytest.approx(1000 / 3 + 1000)
    assert slower.itl(20) == pytest.approx(0.060)
    correction.observe(IntervalLoad(10, 1, 0, 1_000, 100, mean_ttft_s=5.0), PROFILE, 1, 1)  # 300 tokens/s
    assert correction.prefill == 4.0  # a stalled interval moves it only as far as the bound
    correction.observe(IntervalLoad(10, 10, 0, 500, 3_000, mean_ttft_s=0.2), PROFILE, 1, 1)  # 50-token prompts
    assert correction.prefill == 4.0  # their TTFT is overheads, not compute: no news of the prompt speed
