"""Admission by SLO: from an instance's LoadReport, the TTFT a new request would get and the TPOT its
stream and the others would see; a request no instance can serve within `--ttft-slo-ms` /
`--tpot-slo-ms` is refused at once (429) with the seconds after which it would fit (`Retry-After`).

TTFT: the work is the prompt tokens ahead of it at its priority + its own, the queue aged by the time
since the report at the measured prefill rate and grown by what the caller sent since (`sent_tokens`); its
first token comes only when its step ends, and prompts queued behind it fill that step too, so the work is
rounded up to whole steps (`step_tokens`) as far as the whole queue reaches. With the engine's step-cost
fit (load.py) the time is those steps' own cost (with the streams decoding in them) + the tokens' cost;
before it, the work over the measured prefill rate. A prompt a prefill instance computes gets its first token
from the decode instance's next step, which may carry prompts of its own: that step is added
(`predict_decode_step`). TPOT = the engine's fitted step
cost (load.py) with every stream that will be in the batch, this one included, and the prompt tokens its
steps have been carrying.
A stream is admitted while the predicted TPOT stays within TPOT_MARGIN of the SLO: admission keeps the
batch near its limit, so a stream's TPOT (its steps' average) sits near the prediction, and a limit at the
SLO itself leaves half the streams just over it (measured: admitted streams at 100-110 ms of a 100 ms SLO).
A report without measurements yet (a fresh instance) predicts nothing, and nothing is refused on it.
Both predictions are corrected by their recent error before they are judged: TTFT by the caller's average of
measured over predicted (correction.py), TPOT by the instance's own (LoadReport.tpot_error). Callers never
refuse an instance below its floor of in-flight requests (floor.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pdserve.admission.correction import clamp
from pdserve.admission.load import LoadReport

TPOT_MARGIN = 0.9  # admit while the predicted TPOT is at most this share of --tpot-slo-ms


@dataclass(frozen=True)
class SLO:
    ttft: float | None = None  # seconds
    tpot: float | None = None

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> SLO:
        """None or 0: that SLO is off."""
        for name, value in (("--ttft-slo-ms", ttft_ms), ("--tpot-slo-ms", tpot_ms)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be positive (0: off), got {value}")
        return cls(ttft_ms / 1000 if ttft_ms else None, tpot_ms / 1000 if tpot_ms else None)

    @property
    def enabled(self) -> bool:
        return self.ttft is not None or self.tpot is not None


@dataclass(frozen=True)
class Refusal:
    reason: str  # ttft_slo | tpot_slo | rate_limit
    message: str
    retry_after: float  # seconds

    @property
    def error_type(self) -> str:
        """The OpenAI error body's type: a client's own limit, or the server's load."""
        return "rate_limit_exceeded" if self.reason == "rate_limit" else "server_overloaded"

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))  # whole seconds (RFC 9110)


def _drained(report: LoadReport, now: float | None) -> float:
    """Prompt tokens the instance computed since its report, at its measured rate."""
    return max(0.0, (now or time.time()) - report.time) * report.prefill_rate


def predict_ttft(report: LoadReport, prompt_tokens: int, priority: int = 0, sent_tokens: int = 0,
                 now: float | None = None) -> float | None:
    rate = report.prefill_rate
    if rate <= 0:
        return None
    drained = _drained(report, now)
    ahead = max(0.0, report.tokens_ahead(priority) - drained) + sent_tokens
    work = ahead + prompt_tokens
    if not report.step_tokens:
        return work / rate
    steps = math.ceil(work / report.step_tokens)
    everything = max(0.0, report.queued_tokens - drained) + sent_tokens + prompt_tokens
    work = min(everything, steps * report.step_tokens)
    if report.step_base > 0 and report.prompt_token_cost > 0:  # the fit: each step's own cost, and the tokens'
        return steps * (report.step_base + report.decode_cost * report.decoding) + report.prompt_token_cost * work
    return work / rate


def predict_decode_step(report: LoadReport, sent_tokens: int = 0, sent_streams: int = 0,
                        now: float | None = None) -> float:
    """With the engine's step-cost fit: how long a decode instance's next step takes, which a request whose prompt
    was computed elsewhere waits for before its first token there. The step carries the instance's streams, the
    ones joining, and as much of the prompts queued there (its own, and what the caller sent it to compute) as a
    step takes. 0 before the fit: nothing is predicted."""
    if report.step_base <= 0 or report.prompt_token_cost <= 0:
        return 0.0
    queued = max(0.0, report.queued_tokens - _drained(report, now)) + sent_tokens
    carried = min(queued, report.step_tokens) if report.step_tokens else queued
    streams = report.decoding + report.waiting_streams + sent_streams + 1
    return report.step_base + report.decode_cost * streams + report.prompt_token_cost * carried


def predict_tpot(report: LoadReport, sent_streams: int = 0) -> float | None:
    """With the engine's step-cost fit: base + per stream x every stream there will be + per prompt token x the
    prompt tokens its steps with decodes carry lately; before the fit: the recent step time + one stream's cost
    per stream joining."""
    if report.step_time <= 0:
        return None
    joining = report.waiting_streams + sent_streams + 1
    if report.step_base > 0:
        return (report.step_base + report.decode_cost * (report.decoding + joining)
                + report.prompt_token_cost * report.prompt_tokens_per_step)
    return report.step_time + report.decode_cost * joining


def judge_ttft(slo: SLO, report: LoadReport, prompt_tokens: int, priority: int, sent_tokens: int = 0,
               now: float | None = None, correction: float = 1.0, then: float = 0.0
               ) -> tuple[float | None, Refusal | None]:
    """(the predicted TTFT before `correction`, a refusal when the corrected one misses the SLO). `then`: seconds
    the first token waits after the prompt is computed (a decode instance's step, for a prompt computed by a
    prefill instance)."""
    ttft = predict_ttft(report, prompt_tokens, priority, sent_tokens, now)
    if ttft is not None:
        ttft += then
    if slo.ttft is None or ttft is None or ttft * correction <= slo.ttft:
        return ttft, None
    corrected = ttft * correction
    # Retry once the queue ahead has drained by the excess (it drains at the measured rate).
    return ttft, Refusal("ttft_slo", f"the server is overloaded: the predicted time to first token is "
                         f"{corrected * 1000:.0f} ms, above the {slo.ttft * 1000:.0f} ms objective; retry later",
                         corrected - slo.ttft)


def judge_tpot(slo: SLO, report: LoadReport, sent_streams: int = 0) -> Refusal | None:
    """A refusal when the predicted TPOT misses the SLO; never for a stream that would decode alone: it slows
    nobody, and an instance that refused it would learn nothing new and refuse every stream after."""
    alone = report.decoding + report.waiting_streams + sent_streams == 0
    tpot = None if alone else predict_tpot(report, sent_streams)
    if tpot is not None:
        tpot *= clamp(report.tpot_error)
    if slo.tpot is None or tpot is None or tpot <= TPOT_MARGIN * slo.tpot:
        return None
    # Retry when a running stream has ended (at its max_tokens at the latest).
    return Refusal("tpot_slo", f"the server is overloaded: one more stream would make the time per output token "
                   f"{tpot * 1000:.0f} ms, too near the {slo.tpot * 1000:.0f} ms objective; retry later",
                   max(report.next_finish, report.step_time))
