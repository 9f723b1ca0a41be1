"""What a caller sent an instance that the instance's last load report cannot include yet."""

from __future__ import annotations

import time
from collections import deque


class SentSince:
    def __init__(self) -> None:
        self._sent: deque[tuple[float, int, int]] = deque()  # (when, prompt tokens, priority), oldest first

    def add(self, tokens: int, priority: int = 0, now: float | None = None) -> None:
        self._sent.append((now or time.time(), tokens, priority))

    def since(self, report_time: float, priority: int | None = None) -> tuple[int, int]:
        """(prompt tokens ahead of a request of `priority` (all when None), requests) sent after report_time;
        what went before is in the report, and is forgotten."""
        while self._sent and self._sent[0][0] <= report_time:
            self._sent.popleft()
        tokens = sum(t for _, t, p in self._sent if priority is None or p <= priority)
        return tokens, len(self._sent)
