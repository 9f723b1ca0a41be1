"""What a caller sent an instance that the instance's last load report cannot include yet.

Two callers count. The API server counts what it handed its engine, by time (one host, one clock), and folds
what came after the engine's last report into the report it serves at /load. A router counts what it sent each
instance, by a sequence number the instance acknowledges in that served report (the highest it has taken from this
router): a request is forgotten once the instance has it, not once a poll started, which would forget the
requests still on their way through a busy API server (read, tokenized, not yet in any engine report).
"""

from __future__ import annotations

import time
from collections import Counter, deque

import msgspec

from pdserve.admission.load import LoadReport


class SentSince:
    def __init__(self) -> None:
        # (when, prompt tokens, priority, sequence number or -1), oldest first
        self._sent: deque[tuple[float, int, int, int]] = deque()

    def add(self, tokens: int, priority: int = 0, now: float | None = None, seq: int = -1) -> None:
        self._sent.append((now or time.time(), tokens, priority, seq))

    def acknowledge(self, seq: int) -> None:
        """The instance has taken every request up to `seq` (its report includes them): forget them."""
        self._sent = deque(e for e in self._sent if e[3] > seq)

    def since(self, report_time: float, priority: int | None = None) -> tuple[int, int]:
        """(prompt tokens ahead of a request of `priority` (all when None), requests) sent after report_time;
        what went before is in the report, and is forgotten."""
        while self._sent and self._sent[0][0] <= report_time:
            self._sent.popleft()
        tokens = sum(t for _, t, p, _ in self._sent if priority is None or p <= priority)
        return tokens, len(self._sent)

    def fold_into(self, report: LoadReport, acked: int) -> LoadReport:
        """The report as served: what was handed over after it was taken (same clock) queued in it, their prompt
        tokens by priority and each a stream about to join, and `acked` for the router that asks."""
        self.since(report.time)
        queued = Counter(dict(report.queued))
        for _, tokens, priority, _ in self._sent:
            queued[priority] += tokens
        return msgspec.structs.replace(report, queued=sorted(queued.items()), acked=acked,
                                       waiting_streams=report.waiting_streams + len(self._sent))
