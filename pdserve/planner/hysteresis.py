"""When the planner moves to the split the sizing wants (sizing.py), so that it neither lags a burst nor flaps.

A side that needs more instances gets them at the next interval. A side that needs fewer gives one up only after
`down_after` intervals in a row wanted fewer, and never below what the load plus `headroom` needs: the survivors
must absorb what the leavers carried (a planner that scaled down on the bare load flapped 2 <-> 1: Dynamo's #9294).
Within the budget a growing side waits for the other to shrink: a role change moves one instance from one side to
the other.
"""

from __future__ import annotations

from pdserve.planner.sizing import Split

SIDES = ("prefill", "decode")


class Hysteresis:
    def __init__(self, max_instances: int, down_after: int = 2) -> None:
        if down_after < 1:
            raise ValueError("down_after must be at least 1 interval")
        self.max_instances, self.down_after = max_instances, down_after
        self._streak = dict.fromkeys(SIDES, 0)  # intervals in a row a side wanted fewer

    def step(self, current: Split, wanted: Split, with_headroom: Split) -> Split:
        """The split to move to now: `wanted` is the sizing of the predicted load, `with_headroom` of that load
        plus the headroom (the floor a shrinking side keeps)."""
        target = {}
        for side in SIDES:
            have, want, floor = getattr(current, side), getattr(wanted, side), getattr(with_headroom, side)
            if want >= have:
                self._streak[side] = 0
                target[side] = want
                continue
            self._streak[side] += 1
            target[side] = max(want, floor, 1) if self._streak[side] >= self.down_after else have
            if target[side] < have:
                self._streak[side] = 0
        over = target["prefill"] + target["decode"] - self.max_instances
        if over > 0:  # the growing side takes only what the other gives up
            grower = max(SIDES, key=lambda s: target[s] - getattr(current, s))
            target[grower] = max(getattr(current, grower), target[grower] - over)
        return Split(target["prefill"], target["decode"], wanted.meets_slo, wanted.reason)
