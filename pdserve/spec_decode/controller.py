"""Whether a step speculates, from measurement: per batch size, the tokens per second of decode steps
that carried proposals against those that did not.

Verifying 1 + K tokens per sequence is nearly free while a decode step is memory-bound (batch 1 on a
CPU) and a loss once it is compute-bound; where that happens depends on the device, the dtype and how
often proposals are accepted (on 2 Zen 4 cores, ShareGPT greedy: 2-3x at one sequence, 0.8-0.9x at
32, anything from 0.74x to 1.16x between 4 and 16 from run to run; docs/architecture.md). So the
engine times its decode-only steps and, per batch size bucket (1, 2-3, 4-7, 8-15, ...), keeps a moving
average of emitted tokens per second with and without proposals; a step uses its proposals when that
bucket's speculative rate is the higher one. The losing side is still tried on one step in
EXPLORE_EVERY, so a change (other prompts, other load) is seen.
"""

from __future__ import annotations

from dataclasses import dataclass

EXPLORE_EVERY = 16
WARMUP_STEPS = 4  # steps of each kind a bucket measures before it decides
SMOOTHING = 0.1  # weight of the newest step in the moving average


@dataclass
class _Arm:
    rate: float = 0.0  # emitted tokens per second of step time, moving average
    steps: int = 0

    def observe(self, rate: float) -> None:
        self.rate = rate if self.steps == 0 else (1 - SMOOTHING) * self.rate + SMOOTHING * rate
        self.steps += 1


class SpeculationController:
    def __init__(self) -> None:
        self._arms: dict[tuple[int, bool], _Arm] = {}
        self._decisions = 0

    @staticmethod
    def bucket(batch_size: int) -> int:
        return batch_size.bit_length()

    def _arm(self, batch_size: int, speculative: bool) -> _Arm:
        return self._arms.setdefault((self.bucket(batch_size), speculative), _Arm())

    def decide(self, batch_size: int) -> bool:
        """Use this step's proposals?"""
        spec, plain = self._arm(batch_size, True), self._arm(batch_size, False)
        if spec.steps < WARMUP_STEPS or plain.steps < WARMUP_STEPS:
            return spec.steps <= plain.steps
        self._decisions += 1
        explore = self._decisions % EXPLORE_EVERY == 0
        return (spec.rate >= plain.rate) != explore

    def observe(self, batch_size: int, speculative: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` sequences emitted `num_tokens` in `seconds`."""
        if seconds > 0:
            self._arm(batch_size, speculative).observe(num_tokens / seconds)

    def as_dict(self) -> dict:
        """Tokens/s measured per bucket ("spec_b4": speculating steps of 4-7 sequences)."""
        arms = sorted(self._arms.items())
        return {f"{'spec' if spec else 'plain'}_b{2 ** (b - 1)}": round(a.rate, 1) for (b, spec), a in arms}
