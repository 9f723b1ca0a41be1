"""The admission flags, as `pdserve serve`, `router` and `launch` declare them (one text for all three)."""

from __future__ import annotations

from pathlib import Path

from pdserve.admission.predictor import SLO
from pdserve.admission.rate_limit import RateLimits

TTFT_HELP = ("refuse (429, with Retry-After) a request whose predicted time to first token, from the live queue and "
             "the measured prefill speed, exceeds this many ms (default: off)")
TPOT_HELP = ("refuse a new stream when one more would make the decode batch's time per output token exceed this "
             "many ms (default: off)")
RATE_LIMIT_HELP = ("YAML of per-key token buckets (requests/s, tokens/s), read again when it changes; keys are "
                   "Bearer tokens or user:NAME (the `user` field)")


def admission_from_flags(ttft_slo_ms: float | None, tpot_slo_ms: float | None, rate_limit: str | None
                         ) -> tuple[SLO, RateLimits | None]:
    """ValueError naming the flag when one is wrong (a missing or malformed --rate-limit file included)."""
    slo = SLO.from_ms(ttft_slo_ms, tpot_slo_ms)
    if rate_limit is None:
        return slo, None
    path = Path(rate_limit)
    if not path.is_file():
        raise ValueError(f"--rate-limit {rate_limit}: no such file")
    return slo, RateLimits(path)
