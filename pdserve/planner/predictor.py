"""The next interval's load from the intervals seen so far.

Holt's linear smoothing (a level and a trend, each an exponential average) follows a load that ramps; a moving
average follows one that only jitters. Demand counts what was refused and what still waits, not only what was
served: a burst that filled the queues or met admission's refusals is load the next interval must carry (a planner
that read only completions saw no burst at all: Dynamo's #10528).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class Holt:
    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError("Holt smoothing needs 0 < alpha <= 1 and 0 <= beta <= 1")
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def observe(self, x: float) -> None:
        if self.level is None:
            self.level = x
            return
        previous = self.level
        self.level = self.alpha * x + (1 - self.alpha) * (previous + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def predict(self, steps: int = 1) -> float:
        """The value `steps` intervals ahead (never below 0); 0 before any observation."""
        return 0.0 if self.level is None else max(0.0, self.level + steps * self.trend)


class MovingAverage:
    def __init__(self, window: int = 3) -> None:
        if window < 1:
            raise ValueError("a moving average needs a window of at least 1")
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, x: float) -> None:
        self._values.append(x)

    def predict(self, steps: int = 1) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0


@dataclass(frozen=True)
class IntervalLoad:
    """What one interval carried, from the routers' and instances' counters."""

    seconds: float
    requests: int  # answered (any outcome but refused)
    refused: int  # refused by admission or a rate limit: demand all the same
    prompt_tokens: int  # of the answered requests
    output_tokens: int
    queued_prompt_tokens: int = 0  # waiting at the interval's end: work carried into the next
    mean_ttft_s: float | None = None  # of the requests answered (None: none)
    mean_tpot_s: float | None = None
    decoding_streams: float = 0.0  # in the answering instances' batches, on average


@dataclass(frozen=True)
class Load:
    """A predicted interval: requests per second and the mean request's lengths."""

    rate: float
    prompt_len: float
    output_len: float
    backlog_tokens: float = 0.0  # prompt tokens already waiting, to be computed on top of the arrivals

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.rate * self.prompt_len


class LoadPredictor:
    def __init__(self, kind: str = "holt") -> None:
        make = {"holt": Holt, "moving_average": MovingAverage}.get(kind)
        if make is None:
            raise ValueError(f"unknown load predictor {kind!r}: holt or moving_average")
        # Lengths follow a phase change without a trend: Holt's would overshoot a drop from 1,500-token prompts
        # to 50-token ones below zero.
        self._rate, self._prompt, self._output = make(), Holt(beta=0.0), Holt(beta=0.0)
        self._backlog = 0.0

    def observe(self, interval: IntervalLoad) -> None:
        demand = interval.requests + interval.refused
        self._rate.observe(demand / interval.seconds)
        if interval.requests:  # an interval that answered nothing says nothing of lengths
            self._prompt.observe(interval.prompt_tokens / interval.requests)
            self._output.observe(interval.output_tokens / interval.requests)
        self._backlog = float(interval.queued_prompt_tokens)

    def predict(self) -> Load:
        return Load(self._rate.predict(), self._prompt.predict(), self._output.predict(), self._backlog)
