"""The floor of in-flight requests below which an instance is never refused, from its calibration.

An instance that holds only a few requests serves them within the SLOs on its own: refusing there turns away
work a batch client wants answered and protects nobody. The floor is what the calibration (the instance alone,
before any request) says it serves within half of each SLO, so it still holds when a neighbour takes half the
machine; above it, the live prediction judges. An instance that was not calibrated has no floor.
"""

from __future__ import annotations

import math

from pdserve.admission.load import LoadReport
from pdserve.admission.predictor import SLO

FLOOR_HEADROOM = 0.5  # the floor is what fits in this share of each SLO on the quiet instance


def in_flight_floor(slo: SLO, report: LoadReport, prompt_tokens: int | None, decodes: bool) -> int:
    """Requests the instance holds within the SLOs by its calibration: streams whose step stays within
    FLOOR_HEADROOM x TPOT (when it decodes the request), and prompts of this one's size whose prefill fits in
    FLOOR_HEADROOM x TTFT one after another (when it computes the prompt: `prompt_tokens` not None)."""
    if report.quiet_step_base <= 0:
        return 0
    floor = report.max_num_seqs
    if decodes and slo.tpot is not None:
        budget = FLOOR_HEADROOM * slo.tpot - report.quiet_step_base
        if report.quiet_decode_cost > 0:
            floor = min(floor, max(0, math.floor(budget / report.quiet_decode_cost)))
        elif budget < 0:
            floor = 0
    if prompt_tokens is not None and slo.ttft is not None and report.quiet_prefill_rate > 0:
        floor = min(floor, math.floor(FLOOR_HEADROOM * slo.ttft * report.quiet_prefill_rate / max(1, prompt_tokens)))
    return floor


def below_floor(slo: SLO, report: LoadReport, prompt_tokens: int | None, decodes: bool, sent_streams: int = 0
                ) -> bool:
    """The request would be within the floor: the instance's requests (decoding, waiting, sent since its report),
    this one included, are at most the floor."""
    in_flight = report.decoding + report.waiting_streams + sent_streams + 1
    return in_flight <= in_flight_floor(slo, report, prompt_tokens, decodes)
