"""The scheduler's waiting queue, in the order `--scheduling-policy` serves it (vLLM's two policies).

fcfs: arrival order; a preempted request goes back to the head (it is older than anything waiting).
priority: by (priority, arrival): a lower `priority` value is served first, ties in arrival order; a
preempted request goes back to its place by that key. The same key picks a preemption victim: the
running request with the largest key (lowest priority, latest arrival), where fcfs takes the latest admitted.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from pdserve.engine.request import Request

POLICIES = ("fcfs", "priority")


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.by_priority = policy == "priority"
        self._requests: list[Request] = []
        self._keys: list[tuple[int, int]] = []  # priority mode: (priority, arrival order), parallel to _requests
        self._arrivals: dict[str, int] = {}
        self._counter = itertools.count()

    def key(self, request: Request) -> tuple[int, int]:
        arrival = self._arrivals.setdefault(request.request_id, next(self._counter))
        return (request.priority if self.by_priority else 0), arrival

    def append(self, request: Request) -> None:
        """A new request."""
        self._insert(request, head=False)

    def requeue(self, request: Request) -> None:
        """A preempted request."""
        self._insert(request, head=True)

    def _insert(self, request: Request, head: bool) -> None:
        key = self.key(request)
        if self.by_priority:
            i = bisect.bisect_right(self._keys, key)
        else:
            i = 0 if head else len(self._requests)
        self._requests.insert(i, request)
        self._keys.insert(i, key)

    def popleft(self) -> Request:
        self._keys.pop(0)
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        i = self._requests.index(request)  # ValueError when absent, as a deque's
        del self._requests[i], self._keys[i]

    def forget(self, request_id: str) -> None:
        """The request finished: its arrival order is no longer needed."""
        self._arrivals.pop(request_id, None)

    def victim(self, running: list[Request]) -> Request:
        """Whom to preempt among the running when blocks run out."""
        return max(running, key=self.key) if self.by_priority else running[-1]

    def __getitem__(self, i: int) -> Request:
        return self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)
