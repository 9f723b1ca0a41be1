"""How far admission's TTFT predictions have been off lately, to correct the next ones.

Every admitted request's measured TTFT over the TTFT predicted for it (before correction, so the correction
does not feed on itself) moves a moving average; a prediction is multiplied by it before it is judged. Predictions
that ran short (a neighbour took cores, the prompts were costlier than the fit knew) make admission stricter,
ones that ran long make it admit more. TPOT's counterpart needs no history: the instance reports its own
(LoadReport.tpot_error).
"""

from __future__ import annotations

ALPHA = 0.1  # weight of the newest ratio
MIN_OBSERVATIONS = 5  # ratios seen before the average is used: one odd request corrects nothing
BOUNDS = (0.5, 2.0)  # a correction never more than halves or doubles a prediction


def clamp(ratio: float) -> float:
    return min(BOUNDS[1], max(BOUNDS[0], ratio))


class Correction:
    def __init__(self) -> None:
        self._average, self._seen = 1.0, 0

    def observe(self, predicted: float | None, measured: float | None) -> None:
        if not predicted or predicted <= 0 or measured is None or measured < 0:
            return
        ratio = clamp(measured / predicted)
        self._average = ratio if self._seen == 0 else ALPHA * ratio + (1 - ALPHA) * self._average
        self._seen += 1

    @property
    def factor(self) -> float:
        return clamp(self._average) if self._seen >= MIN_OBSERVATIONS else 1.0
