"""What an engine reports of its load, often (every ~20 ms while busy), for admission by SLO.

The engine measures itself: prompt tokens computed per second (in steps that compute prompts, decodes
in the same step included, so it is the rate a queued prompt really gets), the time of a step that
carries decodes (what running streams see as TPOT), and the cost of one more decode stream (a least-squares
fit over recent decode-only steps). The queue is listed by priority, so an admission can count only what
is ahead of a request of its priority.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec


class LoadReport(msgspec.Struct):
    time: float  # wall clock when taken
    queued: list[tuple[int, int]]  # (priority, prompt tokens still to compute), ascending priority
    decoding: int  # streams in the decode batch now
    waiting_streams: int  # requests that will join the decode batch (queued, mid-prefill, awaiting KV)
    max_num_seqs: int
    prefill_rate: float  # prompt tokens per second (0: not measured yet)
    step_time: float  # seconds of a step that carries decodes, lately (0: not measured yet)
    decode_cost: float  # seconds one more decode stream adds to a step (0: not measured yet)
    next_finish: float  # seconds until a running stream reaches its max_tokens at the latest (0: none runs)
    step_tokens: int = 0  # the step's token budget (--max-num-batched-tokens): prompts share steps

    @property
    def queued_tokens(self) -> int:
        return sum(tokens for _, tokens in self.queued)

    def tokens_ahead(self, priority: int) -> int:
        """Prompt tokens that go before a new request of this priority (equal priorities came earlier)."""
        return sum(tokens for p, tokens in self.queued if p <= priority)


class LoadTracker:
    """The engine's side: step timings in, a LoadReport out."""

    ALPHA = 0.2  # weight of the newest step in the moving averages
    FIT_STEPS = 256  # decode-only steps kept for the per-stream cost

    def __init__(self, max_num_seqs: int, step_tokens: int = 0) -> None:
        self.max_num_seqs, self.step_tokens = max_num_seqs, step_tokens
        self._prefill_tokens = self._prefill_seconds = 0.0
        self._step_time = 0.0
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=self.FIT_STEPS)

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        a = self.ALPHA
        if prefill_tokens:
            if self._prefill_seconds == 0.0:
                self._prefill_tokens, self._prefill_seconds = prefill_tokens, seconds
            else:
                self._prefill_tokens = a * prefill_tokens + (1 - a) * self._prefill_tokens
                self._prefill_seconds = a * seconds + (1 - a) * self._prefill_seconds
        if decodes:
            self._step_time = seconds if self._step_time == 0.0 else a * seconds + (1 - a) * self._step_time
            if not prefill_tokens:
                self._decode_steps.append((decodes, seconds))

    @property
    def prefill_rate(self) -> float:
        return self._prefill_tokens / self._prefill_seconds if self._prefill_seconds else 0.0

    def decode_cost(self) -> float:
        """Slope of step time against batch size over recent decode-only steps (0 without two sizes)."""
        steps = self._decode_steps
        if len({n for n, _ in steps}) < 2:
            return 0.0
        mean_n = sum(n for n, _ in steps) / len(steps)
        mean_s = sum(s for _, s in steps) / len(steps)
        var = sum((n - mean_n) ** 2 for n, _ in steps)
        return max(0.0, sum((n - mean_n) * (s - mean_s) for n, s in steps) / var)

    def report(self, queued: dict[int, int], decoding: int, waiting_streams: int, min_tokens_left: int | None
               ) -> LoadReport:
        next_finish = (min_tokens_left or 0) * self._step_time
        return LoadReport(time.time(), sorted(queued.items()), decoding, waiting_streams, self.max_num_seqs,
                          self.prefill_rate, self._step_time, self.decode_cost(), next_finish, self.step_tokens)
