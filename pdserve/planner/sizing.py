"""How many prefill and decode instances a predicted load needs, from a profile of this deployment.

Prefill: an instance computes `prefill_tokens_per_s`; with P of them sharing the prompt tokens, each is busy a
share rho of the time, and a prompt waits as in a single-server queue: TTFT ~ service / (1 - rho), service being
one prompt's compute. The fewest P whose TTFT meets the SLO. Decode: a stream's inter-token latency grows with
its instance's batch, ITL(b) = base + per_stream * b; the batch that just meets the TPOT SLO (at most the
instance's max streams) bounds the streams per instance, and the streams in flight are arrivals x answer length
x ITL (Little's law). Both are given as real numbers of instances (`Needs`), for the role assignment (roles.py)
to weigh; rounded up, each is the count of instances a side needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pdserve.planner.predictor import Load

MAX_UTILIZATION = 0.9  # a side planned busier than this has no room for a burst


class DeploymentProfile(msgspec.Struct, frozen=True):
    """What one instance of this deployment does on this machine (`pdserve planner profile` measures it)."""

    prefill_tokens_per_s: float  # prompt tokens one prefill instance computes per second
    itl_base_s: float  # a decode step's time with no stream ...
    itl_per_stream_s: float  # ... and what each stream in the batch adds
    max_streams: int  # a decode instance's --max-num-seqs

    def itl(self, streams: float) -> float:
        return self.itl_base_s + self.itl_per_stream_s * streams

    def save(self, path: Path) -> None:
        path.write_bytes(msgspec.json.encode(self))

    @classmethod
    def load(cls, path: Path) -> DeploymentProfile:
        return msgspec.json.decode(path.read_bytes(), type=cls)


@dataclass(frozen=True)
class Needs:
    """Instance-equivalents each side needs for the SLOs (1.0: one instance's whole capacity), and why a side
    cannot meet its SLO at any size ("" when it can)."""

    prefill: float
    decode: float
    reason: str = ""

    def scaled(self, factor: float) -> Needs:
        return Needs(self.prefill * factor, self.decode * factor, self.reason)


def prefill_need(load: Load, profile: DeploymentProfile, ttft_slo_s: float, interval_s: float) -> tuple[float, str]:
    """Prefill instances (real-valued) whose predicted TTFT meets the SLO: service / (1 - demand / (P rate)) <= SLO
    and no instance busier than MAX_UTILIZATION ("" or why none can)."""
    rate = profile.prefill_tokens_per_s
    service = load.prompt_len / rate
    demand = load.prefill_tokens_per_s + load.backlog_tokens / interval_s
    if service >= ttft_slo_s:
        return demand / (0.5 * rate), (
            f"one {load.prompt_len:.0f}-token prompt takes {service * 1e3:.0f} ms to compute, past the TTFT SLO")
    return max(demand / (MAX_UTILIZATION * rate), demand / (rate * (1 - service / ttft_slo_s))), ""


def decode_need(load: Load, profile: DeploymentProfile, tpot_slo_s: float) -> tuple[float, str]:
    """Decode instances (real-valued) whose batch keeps the ITL within the SLO ("" or why none can)."""
    if profile.itl(1) > tpot_slo_s:
        return load.rate * load.output_len * profile.itl(1), (
            f"one stream's ITL is {profile.itl(1) * 1e3:.1f} ms, past the TPOT SLO")
    per_instance = profile.max_streams
    if profile.itl_per_stream_s > 0:
        per_instance = min(per_instance, int((tpot_slo_s - profile.itl_base_s) / profile.itl_per_stream_s))
    per_instance = max(1, per_instance)
    streams = load.rate * load.output_len * profile.itl(per_instance)
    return streams / (MAX_UTILIZATION * per_instance), ""


def needs(load: Load, profile: DeploymentProfile, ttft_slo_s: float, tpot_slo_s: float, interval_s: float) -> Needs:
    p, p_why = prefill_need(load, profile, ttft_slo_s, interval_s)
    d, d_why = decode_need(load, profile, tpot_slo_s)
    return Needs(p, d, "; ".join(r for r in (p_why, d_why) if r))


def prefill_instances(load: Load, profile: DeploymentProfile, ttft_slo_s: float, interval_s: float) -> tuple[int, str]:
    """The fewest prefill instances whose predicted TTFT meets the SLO ("" or why none can)."""
    p, why = prefill_need(load, profile, ttft_slo_s, interval_s)
    return max(1, math.ceil(p - 1e-9)), why


def decode_instances(load: Load, profile: DeploymentProfile, tpot_slo_s: float) -> tuple[int, str]:
    """The fewest decode instances whose batch keeps the ITL within the SLO ("" or why none can)."""
    d, why = decode_need(load, profile, tpot_slo_s)
    return max(1, math.ceil(d - 1e-9)), why
