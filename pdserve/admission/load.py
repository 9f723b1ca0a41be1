"""What an engine reports of its load, often (every ~20 ms while busy), for admission by SLO.

The engine measures itself, timing each step's cycle: from its start (scheduling included) to the next
step's, while the loop goes straight from one to the next, so what a stream waits per token outside the
model (applying outputs, sending them, taking new requests) counts too. It measures prompt tokens computed
per second (in steps that compute prompts, decodes in the same step included, so it is the rate a queued
prompt really gets), and what a step costs: a least-squares fit over the last 256 steps of seconds = base +
per stream x streams decoded + per prompt token x prompt tokens computed (prompts share steps with decodes:
chunked prefill on a mixed instance, or a prompt a decode instance computes itself under conditional
disaggregation), with the prompt tokens the steps that carried decodes computed lately. The queue is
listed by priority, so an admission can count only what is ahead of a request of its priority.
"""

from __future__ import annotations

import time

import msgspec

from pdserve.admission.step_fit import StepWindow, fit_step_costs, implausible_fit


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
    step_base: float = 0.0  # the fit's seconds of a step before its streams and prompt tokens (0: no fit yet)
    prompt_token_cost: float = 0.0  # seconds a prompt token adds to a step that carries decodes
    prompt_tokens_per_step: float = 0.0  # prompt tokens the steps that carried decodes computed, lately
    loras: list[str] = []  # LoRA adapters its last step computed with: in its device slots (routers prefer it)
    acked: int = -1  # as served to a router: the highest of its sequence numbers taken (-1: not counted so)
    decodes_per_step: float = 0.0  # streams the steps that carried decodes decoded, lately
    quiet_step_base: float = 0.0  # the calibration's own fit, before any request (0: not calibrated): what the
    quiet_decode_cost: float = 0.0  # instance serves on its own, for the floor of in-flight requests
    quiet_prefill_rate: float = 0.0

    @property
    def tpot_error(self) -> float:
        """The step time measured lately over what the fit says of the same steps (their average streams and
        prompt tokens): above 1 when steps got slower than the fit's 256 steps knew (a neighbour came), below
        when faster; 1 without a fit or decodes."""
        fitted = (self.step_base + self.decode_cost * self.decodes_per_step
                  + self.prompt_token_cost * self.prompt_tokens_per_step)
        if self.step_base <= 0 or self.step_time <= 0 or self.decodes_per_step <= 0 or fitted <= 0:
            return 1.0
        return self.step_time / fitted

    @property
    def queued_tokens(self) -> int:
        return sum(tokens for _, tokens in self.queued)

    def tokens_ahead(self, priority: int) -> int:
        """Prompt tokens that go before a new request of this priority (equal priorities came earlier)."""
        return sum(tokens for p, tokens in self.queued if p <= priority)


class LoadTracker:
    """The engine's side: step timings in, a LoadReport out."""

    ALPHA = 0.2  # weight of the newest step in the moving averages
    FIT_STEPS = 256  # steps kept for the cost fit
    PROMPT_STEP_TOKENS = 64  # a step with this many prompt tokens or more times what computing a prefix costs

    def __init__(self, max_num_seqs: int, step_tokens: int = 0) -> None:
        self.max_num_seqs, self.step_tokens = max_num_seqs, step_tokens
        self._prefill_tokens = self._prefill_seconds = 0.0
        self._prompt_step_rate = 0.0
        self._step_time = self._prompt_per_step = self._decodes_per_step = 0.0
        self._quiet = (0.0, 0.0, 0.0)  # the calibration's (base, per stream, prefill rate)
        self._steps = StepWindow(self.FIT_STEPS)  # (streams, prompt tokens, seconds)
        self._open: tuple[int, int, float] | None = None  # the last step's (prompt tokens, streams, start)

    def step_started(self, now: float) -> None:
        """A step begins (perf_counter): the one before it, if the loop came straight here, ends its cycle."""
        self.cycle_over(now)

    def step_done(self, prefill_tokens: int, decodes: int, started: float) -> None:
        """A step computed; its cycle ends when the next one starts, or when the loop waits (cycle_over)."""
        self._open = (prefill_tokens, decodes, started)

    def cycle_over(self, now: float) -> None:
        if self._open is not None:
            prefill_tokens, decodes, started = self._open
            self._open = None
            self.observe(prefill_tokens, decodes, now - started)

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        a = self.ALPHA
        if prefill_tokens:
            if self._prefill_seconds == 0.0:
                self._prefill_tokens, self._prefill_seconds = prefill_tokens, seconds
            else:
                self._prefill_tokens = a * prefill_tokens + (1 - a) * self._prefill_tokens
                self._prefill_seconds = a * seconds + (1 - a) * self._prefill_seconds
        if prefill_tokens >= self.PROMPT_STEP_TOKENS and prefill_tokens >= 8 * decodes and seconds > 0:
            rate = prefill_tokens / seconds
            self._prompt_step_rate = rate if not self._prompt_step_rate else a * rate + (1 - a) * self._prompt_step_rate
        if decodes:
            first = self._step_time == 0.0
            self._step_time = seconds if first else a * seconds + (1 - a) * self._step_time
            self._prompt_per_step = prefill_tokens if first else a * prefill_tokens + (1 - a) * self._prompt_per_step
            self._decodes_per_step = decodes if first else a * decodes + (1 - a) * self._decodes_per_step
        self._steps.append((decodes, prefill_tokens, seconds))

    def calibrate(self, steps: list[tuple[int, int, float]]) -> str | None:
        """Seed the fit with timed (streams, prompt tokens, seconds) steps taken before any request came: the
        prefill rate from the largest prompt-only step, the step time from the decode-only ones; real steps
        then push them out of the fit. Steps whose fit cannot be right seed nothing: why, or None."""
        if refusal := implausible_fit(fit_step_costs(steps), steps):
            return refusal
        self._steps.extend((decodes, prompt, seconds) for decodes, prompt, seconds in steps)
        prompts = [(p, s) for n, p, s in steps if p and not n]
        if prompts:
            self._prefill_tokens, self._prefill_seconds = max(prompts)
        decodes = [(n, s) for n, p, s in steps if n and not p]
        if decodes:
            self._step_time = sum(s for _, s in decodes) / len(decodes)
            self._decodes_per_step = sum(n for n, _ in decodes) / len(decodes)
        base, per_stream, _ = self.step_costs()
        self._quiet = (base, per_stream, self.prefill_rate)
        return None

    @property
    def prefill_rate(self) -> float:
        return self._prefill_tokens / self._prefill_seconds if self._prefill_seconds else 0.0

    @property
    def prompt_step_rate(self) -> float:
        """Prompt tokens per second in steps that were mostly prompt (PROMPT_STEP_TOKENS or more, at least 8 per
        decode beside them): what computing a prefix costs. The average over all prompt steps (`prefill_rate`)
        counts steps that computed a token or two beside a batch of decodes, and the step fit's per-token term
        is noisy when other processes share the cores. 0 before such a step."""
        return self._prompt_step_rate

    def step_costs(self) -> tuple[float, float, float]:
        """(base, per stream, per prompt token) seconds of a step, fitted over the last FIT_STEPS steps; zeros
        until they vary in their stream counts, and while the fit is implausible (implausible_fit)."""
        costs = self._steps.fit()
        return (0.0, 0.0, 0.0) if implausible_fit(costs, self._steps) else costs

    def report(self, queued: dict[int, int], decoding: int, waiting_streams: int, min_tokens_left: int | None,
               loras: list[str] | None = None) -> LoadReport:
        next_finish = (min_tokens_left or 0) * self._step_time
        base, per_stream, per_token = self.step_costs()
        quiet_base, quiet_cost, quiet_rate = self._quiet
        return LoadReport(time.time(), sorted(queued.items()), decoding, waiting_streams, self.max_num_seqs,
                          self.prefill_rate, self._step_time, per_stream, next_finish, self.step_tokens, base,
                          per_token, self._prompt_per_step, loras or [], decodes_per_step=self._decodes_per_step,
                          quiet_step_base=quiet_base, quiet_decode_cost=quiet_cost, quiet_prefill_rate=quiet_rate)
