"""Which role each instance of a fixed pool should have for the predicted needs, and when to move to it.

A prefill instance gives the prompt side one instance of capacity, a decode instance the decode side one, and a
mixed instance either side what the other leaves: the pool copes with needs (p, d) while p <= P + M, d <= D + M and
p + d <= P + D + M. The pressure of an assignment is the largest of those ratios (above 1: it misses an SLO).
Among the assignments that keep a prompt computer (P + M >= 1) and a decode side (D + M >= 1), the best is the one
with the fewest mixed instances whose pressure is at most 1 (mixed instances pay prefill's interference on their
streams' ITL: pure roles first, as PD does), else the one with the least pressure.

When to move (`RolePlanner.step`): at once when the current roles miss the SLO and the target relieves them (a
burst moves capacity: the planner that waited saw TTFT p99 go 1.3 -> 9.7 s, Dynamo's #10528); otherwise only after
`settle` intervals in a row wanted the same target, and only if the target still copes with the load plus
`headroom` (the instances a side keeps must absorb what the leavers carried: a planner that ignored that flapped
2 <-> 1, Dynamo's #9294).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pdserve.planner.sizing import Needs

ROLES = ("prefill", "decode", "mixed")


@dataclass(frozen=True, order=True)
class RoleCounts:
    prefill: int
    decode: int
    mixed: int = 0

    @property
    def total(self) -> int:
        return self.prefill + self.decode + self.mixed

    @property
    def serves(self) -> bool:
        """Some instance computes prompts and some takes the decode side."""
        return self.prefill + self.mixed >= 1 and self.decode + self.mixed >= 1

    def pressure(self, need: Needs) -> float:
        def ratio(need: float, capacity: int) -> float:
            return need / capacity if capacity else float("inf") if need else 0.0

        return max(ratio(need.prefill, self.prefill + self.mixed), ratio(need.decode, self.decode + self.mixed),
                   ratio(need.prefill + need.decode, self.total))

    def __str__(self) -> str:
        return f"{self.prefill}P {self.decode}D {self.mixed}M"

    @classmethod
    def of(cls, roles: list[str]) -> RoleCounts:
        return cls(roles.count("prefill"), roles.count("decode"), roles.count("mixed"))


def best_roles(need: Needs, current: RoleCounts) -> RoleCounts:
    """The assignment of `current.total` instances the needs want; the current one where it is as good."""
    n = current.total
    candidates = [c for p, d in itertools.product(range(n + 1), repeat=2)
                  if p + d <= n and (c := RoleCounts(p, d, n - p - d)).serves]
    if not candidates:
        raise ValueError("a pool needs at least one instance")
    meeting = [c for c in candidates if c.pressure(need) <= 1]
    if meeting:
        return min(meeting, key=lambda c: (c.mixed, c != current, c.pressure(need)))
    return min(candidates, key=lambda c: (round(c.pressure(need), 6), c.mixed, c != current))


@dataclass(frozen=True)
class Decision:
    target: RoleCounts
    move: bool
    reason: str


class RolePlanner:
    def __init__(self, settle: int = 2, headroom: float = 0.2) -> None:
        if settle < 1 or headroom < 0:
            raise ValueError("settle must be at least 1 interval and headroom at least 0")
        self.settle, self.headroom = settle, headroom
        self._wanted: RoleCounts | None = None
        self._streak = 0

    def step(self, current: RoleCounts, need: Needs) -> Decision:
        target = best_roles(need, current)
        if target == current:
            self._wanted, self._streak = None, 0
            pressure = current.pressure(need)
            verdict = "fits" if pressure <= 1 else "is the best split there is, and misses the SLOs"
            return Decision(current, False, f"{current} {verdict} (pressure {pressure:.2f})")
        self._streak = self._streak + 1 if target == self._wanted else 1
        self._wanted = target
        now, then = current.pressure(need), target.pressure(need)
        if now > 1 and then < now:
            return self._moved(target, f"{current} misses the SLOs (pressure {now:.2f}); {target}: {then:.2f}")
        if self._streak < self.settle:
            return Decision(current, False, f"{target} wanted {self._streak} of {self.settle} intervals")
        loaded = target.pressure(need.scaled(1 + self.headroom))
        if loaded > 1 and loaded >= now:
            return Decision(current, False, f"{target} could not absorb the load plus {self.headroom:.0%} headroom "
                            f"(pressure {loaded:.2f})")
        return self._moved(target, f"{target} wanted {self._streak} intervals; pressure {now:.2f} -> {then:.2f}")

    def _moved(self, target: RoleCounts, reason: str) -> Decision:
        self._wanted, self._streak = None, 0
        return Decision(target, True, reason)


def changes(roles: dict[str, str], target: RoleCounts, busy: dict[str, int]) -> list[tuple[str, str]]:
    """(instance, new role) moves from `roles` (instance -> role) to the target counts: the instances of a role in
    surplus change, the least busy first (they drain soonest)."""
    have = RoleCounts.of(list(roles.values()))
    surplus = {r: getattr(have, r) - getattr(target, r) for r in ROLES}
    deficit = [r for r in ROLES for _ in range(max(0, -surplus[r]))]
    leaving = sorted((i for i in roles if surplus[roles[i]] > 0), key=lambda i: (busy.get(i, 0), i))
    moves, taken = [], dict.fromkeys(ROLES, 0)
    for instance in leaving:
        role = roles[instance]
        if taken[role] < surplus[role] and deficit:
            taken[role] += 1
            moves.append((instance, deficit.pop(0)))
    return moves
