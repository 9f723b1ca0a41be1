"""The planner's /metrics: what it predicted, what it wants, what it did and how long that took."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.planner.correction import Correction
from pdserve.planner.predictor import Load
from pdserve.planner.roles import ROLES, RoleCounts
from pdserve.planner.sizing import Needs

ACTION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PlannerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.rate = Gauge("pdserve_planner_predicted_requests_per_second", "the next interval's arrivals",
                          registry=r)
        self.prompt_len = Gauge("pdserve_planner_predicted_prompt_tokens", "the next interval's mean prompt",
                                registry=r)
        self.output_len = Gauge("pdserve_planner_predicted_output_tokens", "the next interval's mean answer",
                                registry=r)
        self.need = Gauge("pdserve_planner_need_instances", "instance-equivalents each side needs for the SLOs",
                          ["side"], registry=r)
        self.target = Gauge("pdserve_planner_target_instances", "instances the planner wants in each role",
                            ["role"], registry=r)
        self.actual = Gauge("pdserve_planner_instances", "instances in each role now (those that may change "
                            "role)", ["role"], registry=r)
        self.pressure = Gauge("pdserve_planner_pressure", "the current roles' load over their capacity (above 1: "
                              "an SLO is missed)", registry=r)
        self.actions = Counter("pdserve_planner_actions", "role changes asked, by outcome",
                               ["to_role", "outcome"], registry=r)
        self.action_seconds = Histogram("pdserve_planner_action_seconds", "a role change, asked to answered "
                                        "(drain included)", buckets=ACTION_BUCKETS, registry=r)
        self.correction = Gauge("pdserve_planner_correction", "how far the deployment is from the profile: prefill, "
                                "the profile's speed over the observed; decode, the observed ITL over the "
                                "profile's", ["side"], registry=r)
        self.intervals = Counter("pdserve_planner_intervals", "intervals looked at", registry=r)

    def looked(self, load: Load, need: Needs, current: RoleCounts, target: RoleCounts,
               correction: Correction) -> None:
        self.intervals.inc()
        self.correction.labels("prefill").set(correction.prefill)
        self.correction.labels("decode").set(correction.decode)
        self.rate.set(load.rate)
        self.prompt_len.set(load.prompt_len)
        self.output_len.set(load.output_len)
        self.need.labels("prefill").set(need.prefill)
        self.need.labels("decode").set(need.decode)
        self.pressure.set(current.pressure(need))
        for role in ROLES:
            self.target.labels(role).set(getattr(target, role))
            self.actual.labels(role).set(getattr(current, role))

    def acted(self, role: str, outcome: str, seconds: float) -> None:
        self.actions.labels(role, outcome).inc()
        self.action_seconds.observe(seconds)
