"""What a step costs: seconds = base + per stream x streams decoded + per prompt token x prompt tokens computed,
least squares over the last steps.

The window keeps the fit's normal equations as running sums, updated as a step comes in and the oldest goes
out, so a fit costs the same at any window length: the engine refits for every load report (every ~20 ms while
busy), and a fit over 256 steps in Python took ~0.37 ms of the engine's step cycle.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator

Step = tuple[int, int, float]  # (streams decoded, prompt tokens computed, seconds)

MIN_BASE = 1e-6  # seconds: a fitted base of 0 would read as "no fit yet"
RESUM_WINDOWS = 64  # the sums are added afresh after this many windows of steps went through


class _Sums:
    """sum(x x^T) and sum(x y) over steps, x = (1, streams, prompt tokens), y = seconds."""

    def __init__(self) -> None:
        self.c = self.n = self.p = self.nn = self.np = self.pp = self.s = self.ns = self.ps = 0.0

    def add(self, step: Step, sign: float = 1.0) -> None:
        n, p, s = step
        self.c += sign
        self.n += sign * n
        self.p += sign * p
        self.nn += sign * n * n
        self.np += sign * n * p
        self.pp += sign * p * p
        self.s += sign * s
        self.ns += sign * n * s
        self.ps += sign * p * s

    @property
    def xx(self) -> list[list[float]]:
        return [[self.c, self.n, self.p], [self.n, self.nn, self.np], [self.p, self.np, self.pp]]

    @property
    def xy(self) -> list[float]:
        return [self.s, self.ns, self.ps]


class StepWindow:
    """The last `size` steps, with the sums their fits need."""

    def __init__(self, size: int, steps: Iterable[Step] = ()) -> None:
        self.steps: deque[Step] = deque(maxlen=size)
        self._since_resum = 0
        self._reset()
        for step in steps:
            self.append(step)

    def _reset(self) -> None:
        self.every = _Sums()  # every step
        self.decode_only = _Sums()  # steps that decoded and computed no prompt token
        self.streams: Counter[int] = Counter()
        self.decode_only_streams: Counter[int] = Counter()
        self.prompt_tokens: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def append(self, step: Step) -> None:
        if len(self.steps) == self.steps.maxlen:
            self._count(self.steps[0], -1)
            self._since_resum += 1
        self.steps.append(step)
        self._count(step, 1)
        if self._since_resum >= RESUM_WINDOWS * (self.steps.maxlen or 0):  # added to and taken from, sums drift
            self._since_resum = 0
            self._reset()
            for kept in self.steps:
                self._count(kept, 1)

    def extend(self, steps: Iterable[Step]) -> None:
        for step in steps:
            self.append(step)

    def _count(self, step: Step, sign: int) -> None:
        n, p, _ = step
        self.every.add(step, sign)
        _tally(self.streams, n, sign)
        _tally(self.prompt_tokens, p, sign)
        if n and not p:
            self.decode_only.add(step, sign)
            _tally(self.decode_only_streams, n, sign)

    def fit(self) -> tuple[float, float, float]:
        """(base, per stream, per prompt token) seconds of a step; zeros until the steps vary in their stream
        counts. Where decode-only steps of two or more batch sizes exist, base and per stream come from them and
        the per-token cost from what the prompt steps took beyond that: a prompt's cost grows faster than its
        length (attention), so one straight line through both kinds of step put the base below zero (a 2-core
        box: 256 and 1,024-token chunks in 0.16 and 0.74 s) and dropped it. Else one fit of the three, a
        prompt-token cost only where prompt tokens varied. No cost is negative: a term the fit makes negative is
        left out and the others fitted again (a decode instance that computed two prompts of nearly one length
        under conditional PD once gave base -3.3 s and 3.3 s per stream, and every request after was refused).
        A fit's base is at least MIN_BASE, so a report shows that it has one."""
        if len(self.streams) < 2:
            return 0.0, 0.0, 0.0
        if len(self.decode_only_streams) >= 2:
            base, per_stream, _ = _fit_nonnegative(self.decode_only, [0, 1])
            e = self.every  # its sums of p, p n, p^2 and p s are the prompt steps' (p = 0 adds nothing)
            beyond = e.ps - base * e.p - per_stream * e.np
            per_token = max(0.0, beyond / e.pp) if e.pp > 0 else 0.0
            return max(MIN_BASE, base), per_stream, per_token
        terms = [0, 1, 2] if len(self.prompt_tokens) >= 2 else [0, 1]
        base, per_stream, per_token = _fit_nonnegative(self.every, terms)
        return max(MIN_BASE, base), per_stream, per_token


def _tally(counter: Counter[int], key: int, sign: int) -> None:
    counter[key] += sign
    if not counter[key]:
        del counter[key]


def fit_step_costs(steps: Iterable[Step]) -> tuple[float, float, float]:
    """StepWindow.fit over these steps."""
    steps = list(steps)
    return StepWindow(max(1, len(steps)), steps).fit()


def implausible_fit(costs: tuple[float, float, float], steps: Iterable[Step]) -> str | None:
    """Why a fit of these steps cannot be a step's cost, or None: a base of zero (the fit dropped it: every step
    costs something before its streams), or one stream costing more than a whole step of one stream measured
    (calibrated beside another instance's calibration: `step 0.0 ms + 3.45 ms per stream`)."""
    base, per_stream, _ = costs
    if base == 0.0 and per_stream == 0.0:
        return None  # no fit yet: nothing to judge
    if base <= MIN_BASE:
        return f"the fitted step base is zero ({per_stream * 1e3:.2f} ms per stream)"
    single = [s for n, p, s in steps if n == 1 and p == 0]
    if single and per_stream > min(single):
        return (f"one more stream costs {per_stream * 1e3:.2f} ms in the fit, more than a measured one-stream step "
                f"({min(single) * 1e3:.2f} ms)")
    return None


def _fit_nonnegative(sums: _Sums, terms: list[int]) -> tuple[float, float, float]:
    """Least squares over the columns `terms`; a negative coefficient's column is left out and the rest fitted
    again."""
    while True:
        xx, xy = sums.xx, sums.xy
        coef = _solve([[xx[i][j] for j in terms] for i in terms], [xy[i] for i in terms])
        worst = min(range(len(terms)), key=lambda i: coef[i])
        if coef[worst] >= 0 or len(terms) == 1:
            break
        del terms[worst]
    costs = [0.0, 0.0, 0.0]
    for t, c in zip(terms, coef, strict=True):
        costs[t] = max(0.0, c)
    return costs[0], costs[1], costs[2]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """The normal equations a c = b (Gaussian elimination; a tiny ridge keeps a degenerate column at 0)."""
    k = len(b)
    a = [[v + (1e-9 if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(a)]
    b = list(b)
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(col + 1, k):
            f = a[i][col] / a[col][col]
            a[i] = [x - f * z for x, z in zip(a[i], a[col], strict=True)]
            b[i] -= f * b[col]
    c = [0.0] * k
    for i in reversed(range(k)):
        c[i] = (b[i] - sum(a[i][j] * c[j] for j in range(i + 1, k))) / a[i][i]
    return c
