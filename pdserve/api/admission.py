"""`pdserve serve`'s admission: refuse at once (429 + Retry-After) what its engines cannot serve within the
SLOs (`--ttft-slo-ms`, `--tpot-slo-ms`) or what a client key's rate limit does not allow (`--rate-limit`).
The router does the same across instances (router/admission.py); both use pdserve/admission."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request

from pdserve.admission.correction import Correction
from pdserve.admission.floor import below_floor
from pdserve.admission.load import LoadReport
from pdserve.admission.metrics import AdmissionMetrics
from pdserve.admission.predictor import SLO, Refusal, judge_tpot, judge_ttft
from pdserve.admission.rate_limit import RateLimits, client_key
from pdserve.admission.sent import SentSince


@dataclass
class Admitted:
    key: str
    predicted_ttft: float | None


class ServerAdmission:
    def __init__(self, slo: SLO, limits: RateLimits | None, metrics: AdmissionMetrics, api_key: str | None,
                 sent: SentSince) -> None:
        """`sent`: what the server handed its engines (its caller adds every request it takes); one for all ranks:
        a data-parallel server is judged conservatively."""
        self.slo, self.limits, self.metrics, self.api_key, self.sent = slo, limits, metrics, api_key, sent
        self.ttft_correction = Correction()

    def admit(self, raw: Request, user: str | None, reports: list[LoadReport | None], prompt_tokens: int,
              priority: int, received: float, decodes: bool = True) -> Admitted | Refusal:
        """`received`: the request's arrival (unix seconds), for the time the decision took; `decodes`: it opens
        a stream (max_tokens above 1), else it is never refused on TPOT: it slows no stream."""
        ttft, refusal = self._judge(reports, prompt_tokens, priority, decodes)
        key = client_key(raw.headers.get("authorization"), user, self.api_key)
        if refusal is None and self.limits is not None:
            refusal = self.limits.admit(key, prompt_tokens)
        self.metrics.count(refusal, priority, time.time() - received)
        if refusal is not None:
            return refusal
        return Admitted(key, ttft)

    def _judge(self, reports: list[LoadReport | None], prompt_tokens: int, priority: int, decodes: bool
               ) -> tuple[float | None, Refusal | None]:
        """The best rank's prediction; a refusal only when no rank meets the SLOs (or is below its floor)."""
        if not self.slo.enabled:
            return None, None
        best: tuple[float | None, Refusal | None] | None = None
        for report in reports:
            if report is None:  # a rank that has not reported yet: nothing to refuse on
                return None, None
            tokens, streams = self.sent.since(report.time, priority)
            ttft, refusal = judge_ttft(self.slo, report, prompt_tokens, priority, tokens,
                                       correction=self.ttft_correction.factor)
            if decodes:
                refusal = refusal or judge_tpot(self.slo, report, streams)
            if refusal is not None and below_floor(self.slo, report, prompt_tokens, decodes, streams):
                refusal = None
            if refusal is None:
                return ttft, None
            if best is None or refusal.retry_after < best[1].retry_after:
                best = (ttft, refusal)
        return best if best is not None else (None, None)

    def finished(self, admitted: Admitted, completion_tokens: int, measured_ttft: float | None) -> None:
        if self.limits is not None:
            self.limits.charge(admitted.key, completion_tokens)
        self.metrics.observe_ttft(admitted.predicted_ttft, measured_ttft)
        self.ttft_correction.observe(admitted.predicted_ttft, measured_ttft)
        self.metrics.ttft_correction.labels("").set(self.ttft_correction.factor)
