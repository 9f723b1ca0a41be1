"""Admission's Prometheus series, the same on the router (`pdserve_router_` ...) and on an instance (`pdserve_` ...)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.admission.predictor import Refusal

RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)
DECISION_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.decisions = Counter(f"{prefix}_admission_decisions", "requests admitted or refused (429), by reason "
                                 "(ttft_slo, tpot_slo, rate_limit) and priority", ["decision", "reason", "priority"],
                                 registry=registry)
        self.decision_seconds = Histogram(f"{prefix}_admission_decision_seconds",
                                          "from the request's arrival (its body read) to admission's decision; "
                                          "a refusal's 429 leaves at once", ["decision"],
                                          buckets=DECISION_BUCKETS, registry=registry)
        self.ttft_error = Histogram(f"{prefix}_admission_ttft_measured_over_predicted",
                                    "admitted requests' measured TTFT over the TTFT admission predicted",
                                    buckets=RATIO_BUCKETS, registry=registry)
        self.ttft_correction = Gauge(f"{prefix}_admission_ttft_correction",
                                     "what predicted TTFTs are multiplied by before they are judged: measured over "
                                     "predicted lately (1 until 5 are seen; within 0.5-2), by instance on a router",
                                     ["instance"], registry=registry)

    def count(self, refusal: Refusal | None, priority: int, seconds: float) -> None:
        decision = "admitted" if refusal is None else "refused"
        self.decisions.labels(decision, "" if refusal is None else refusal.reason, str(priority)).inc()
        self.decision_seconds.labels(decision).observe(seconds)

    def observe_ttft(self, predicted: float | None, measured: float | None) -> None:
        if predicted and measured is not None and predicted > 0:
            self.ttft_error.observe(measured / predicted)
