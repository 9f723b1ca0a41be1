"""How far the profile is from what the deployment shows, as Dynamo's planner corrects its own: the profile is
measured on a quiet instance, while a deployment's instances share the box's cores, memory bandwidth and the
routers' and clients' time.

Prefill: the queueing model says TTFT = (L / r) / (1 - D / (c r)) for prompts of L tokens, D prompt tokens per
second over c instances of speed r; solved for r, the speed that explains the TTFT observed is r = L / TTFT + D / c.
Decode: the mean time per output token observed over the profile's ITL at the mean batch per decode-side instance.
Each factor (profile over observed speed) is smoothed over intervals and kept within [0.5, 4]: a noisy interval
moves it, none takes it over; short prompts leave the prefill factor alone.
"""

from __future__ import annotations

import msgspec

from pdserve.planner.predictor import IntervalLoad
from pdserve.planner.sizing import DeploymentProfile

BOUNDS = (0.5, 4.0)
# Short prompts' TTFT is mostly what is not compute (the router, the PD exchange, the first decode step): it says
# nothing of the prompt speed, so intervals whose mean prompt computes in less than this leave the factor alone.
MIN_SERVICE_S = 0.1


class Correction:
    def __init__(self, smoothing: float = 0.5) -> None:
        self.smoothing = smoothing
        self.prefill = 1.0  # the profile's prefill speed over the speed observed
        self.decode = 1.0  # the ITL observed over the profile's

    def observe(self, load: IntervalLoad, profile: DeploymentProfile, prefill_capacity: float,
                decode_capacity: float) -> None:
        prompt = load.prompt_tokens / load.requests if load.requests else 0.0
        if load.mean_ttft_s and prompt / profile.prefill_tokens_per_s >= MIN_SERVICE_S and prefill_capacity > 0:
            speed = prompt / load.mean_ttft_s + load.prompt_tokens / load.seconds / prefill_capacity
            self.prefill = self._smooth(self.prefill, profile.prefill_tokens_per_s / speed)
        if load.mean_tpot_s and decode_capacity > 0:
            expected = profile.itl(load.decoding_streams / decode_capacity)
            self.decode = self._smooth(self.decode, load.mean_tpot_s / expected)

    def _smooth(self, old: float, new: float) -> float:
        new = min(max(new, BOUNDS[0]), BOUNDS[1])
        return (1 - self.smoothing) * old + self.smoothing * new

    def applied(self, profile: DeploymentProfile) -> DeploymentProfile:
        return msgspec.structs.replace(profile, prefill_tokens_per_s=profile.prefill_tokens_per_s / self.prefill,
                                       itl_base_s=profile.itl_base_s * self.decode,
                                       itl_per_stream_s=profile.itl_per_stream_s * self.decode)
