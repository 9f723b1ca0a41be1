"""Core lending between a prefill and a decode instance on one CPU box (`pdserve launch`, CPU only).

Disaggregation halves a small box: each side computes on its own cores. Under real traffic the prefill
side is idle most of the time (at 0.4 req/s of ShareGPT on 2 cores, P's worker was busy 29% of the time
and D's 100%), so its cores sit unused while D is the bottleneck. With lending, P's worker raises a
flag in a small shared file while it computes a step; D's worker, before each step, runs on its own
cores plus P's when the flag is down, and on its own alone when it is up. So D decodes on the whole box
while no prompt is being prefilled, and P's prefills never share a core with D's threads for longer
than the one D step that was running when P started (the cost SGLang's PD multiplexing pays on GPUs
by re-splitting SMs).

D's process may run on both core sets (its OpenMP team is created there), its main thread is pinned to
its own cores, so the torch threads it drops when P is busy are the ones on P's cores.

The flag file holds two bytes: P's "computing" and D's "on your cores". D raises its byte before it looks at
P's and runs a step on the borrowed cores only if P's is down; P raises its byte and then waits (at most
LENDER_WAIT_S) until D's is down before it computes. Without the wait, a prompt arriving mid-step found one of
D's OpenMP threads on its core: both teams then waited on a preempted thread at every barrier, which
stretched D's step (an inter-token gap) and P's first chunk together.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

LEND_ENV = "PDSERVE_LEND_CORES"  # prefill worker: the flag file it raises while computing
BORROW_ENV = "PDSERVE_BORROW_CORES"  # decode worker: FLAG_FILE:OWN_CORES:BORROWED_CORES (cores as 0,1,...)
FLAG_BYTES = 64
ALONE_WAIT_S = 30.0  # a calibration step waits at most this long for the lender to finish its own steps
LENDER_WAIT_S = 0.2  # a lender waits at most this long for a borrowed step to end (longer: a dead borrower's byte)
COMPUTING, BORROWING = 0, 1  # the flag file's bytes: the lender computes; the borrower runs on the lent cores
T = TypeVar("T")


def create_flag(path: Path) -> Path:
    path.write_bytes(b"\0" * FLAG_BYTES)
    return path


def _map(path: str) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), FLAG_BYTES)


class Lender:
    def __init__(self, path: str) -> None:
        self._flag = _map(path)

    def run(self, step: Callable[[], T]) -> T:
        self._flag[COMPUTING] = 1
        deadline = time.monotonic() + LENDER_WAIT_S
        while self._flag[BORROWING] and time.monotonic() < deadline:
            time.sleep(0.0005)
        try:
            return step()
        finally:
            self._flag[COMPUTING] = 0

    def run_timed(self, steps: Callable[[Callable[[Callable[[], T]], T]], object]) -> object:
        """Admission's calibration: the flag up for all of it, so the borrower stays off these cores meanwhile."""
        return self.run(lambda: steps(lambda step: step()))


class Borrower:
    def __init__(self, path: str, own: set[int], borrowed: set[int]) -> None:
        import torch

        self._torch = torch
        self._flag = _map(path)
        self.own, self.all = len(own), len(own) + len(borrowed)
        torch.set_num_threads(self.all)
        torch.randn(1 << 20).sum()  # the OpenMP team is created now, free to run on every core
        os.sched_setaffinity(0, own)  # this thread only (Linux): the team's master stays on D's cores
        self.threads = self.all
        self._flag[BORROWING] = 0  # a borrower that died mid-step left it up

    def run(self, step: Callable[[], T]) -> T:
        self._flag[BORROWING] = 1  # first, then look: a lender raising its flag now waits for this step
        borrowing = not self._flag[COMPUTING]
        if not borrowing:
            self._flag[BORROWING] = 0
        want = self.all if borrowing else self.own
        if want != self.threads:
            self._torch.set_num_threads(want)
            self.threads = want
        try:
            return step()
        finally:
            self._flag[BORROWING] = 0

    def run_timed(self, steps: Callable[[Callable[[Callable[[], T]], T]], object]) -> object:
        """Admission's calibration: each timed step waits until the lender computes nothing (its own calibration
        included, at most ALONE_WAIT_S) and runs on every core, so the times are this instance's alone, not a
        mix of one core and two cores fighting over one (a step then took 118 ms whatever its batch)."""
        def alone(step: Callable[[], T]) -> T:
            deadline = time.monotonic() + ALONE_WAIT_S
            while self._flag[COMPUTING] and time.monotonic() < deadline:
                time.sleep(0.005)
            return self.run(step)

        return steps(alone)


def from_env() -> Lender | Borrower | None:
    if path := os.environ.get(LEND_ENV):
        return Lender(path)
    if spec := os.environ.get(BORROW_ENV):
        path, own, borrowed = spec.rsplit(":", 2)
        return Borrower(path, _cores(own), _cores(borrowed))
    return None


def borrow_spec(path: Path, own: set[int], borrowed: set[int]) -> str:
    return f"{path}:{','.join(map(str, sorted(own)))}:{','.join(map(str, sorted(borrowed)))}"


def _cores(text: str) -> set[int]:
    return {int(c) for c in text.split(",") if c}
