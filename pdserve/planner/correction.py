"""How far the profile is from what the deployment shows, as Dynamo's planner corrects its own: the profile is
measured on a quiet instance, while a deployment's instances share the box's cores, memory bandwidth and the
routers' and clients' time.

Prefill: the queueing model says TTFT = (L / r) / (1 - D / (c r)) for prompts of L tokens, D prompt tokens per
second over c instances of speed r; solved for r, the speed that explains the TTFT observed is r = L / TTFT + D / c.
Decode: the mean time per output token observed over the profile's ITL at the mean batch per decode-side instance.
Each factor (profile over observed speed) is smoothed over intervals and kept within [0.5, 4]: a noisy interval
moves it, none takes it over.
"""

from __future__ import annotations

import msgspec

from pdserve.planner.predictor import IntervalLoad
from pdserve.planner.sizing import DeploymentProfile

BOUNDS = (0.5, 4.0)


class Correction:
    def __init__(self, smoothing: float = 0.5) -> None:
        self.smoothing = smoothing
        self.prefill = 1.0  # the profile's prefill speed over the speed observed
        self.decode = 1.0  # the ITL observed over the profile's

    def observe(self, load: IntervalLoad, profile: DeploymentProfile, prefill_capacity: float,
                decode_capacity: float) -> None:
        if load.mean_ttft_s and load.requests and prefill_capacity > 0:
            prompt = load.prompt_tokens / load.requests
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
