"""What happened in the last minute: moments with optional values, trimmed as they age, for live views."""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 60.0


class RecentEvents:
    """Events (a moment and a value, or None) of the last `window` seconds."""

    def __init__(self, window: float = WINDOW_S) -> None:
        self.window = window
        self._events: deque[tuple[float, float | None]] = deque()

    def add(self, value: float | None = None, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, value))

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()

    def count(self, now: float | None = None) -> int:
        self._trim(time.monotonic() if now is None else now)
        return len(self._events)

    def percentiles(self, qs: tuple[float, ...] = (0.5, 0.9), now: float | None = None) -> dict[str, float | None]:
        """The values' percentiles (nearest rank), as {"p50": ..., "p90": ...}; None with no value."""
        self._trim(time.monotonic() if now is None else now)
        values = sorted(v for _, v in self._events if v is not None)
        out: dict[str, float | None] = {}
        for q in qs:
            out[f"p{round(q * 100)}"] = values[min(int(q * len(values)), len(values) - 1)] if values else None
        return out
