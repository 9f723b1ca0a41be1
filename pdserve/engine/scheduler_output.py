"""What a step's scheduling decided, apart from the scheduler that decides it (vLLM's sched/output.py): the engine
core runs it, the PD connectors read it, and neither needs the scheduler for that."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # known tokens + proposals
    draft_token_ids: list[int] = field(default_factory=list)  # proposals after the last known token

    @property
    def completes_known_tokens(self) -> bool:
        """True when this chunk reaches the request's last known token, so its logits give a new token."""
        known = self.num_new_tokens - len(self.draft_token_ids)
        return self.request.num_computed_tokens + known == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    scheduled_at: float = field(default_factory=time.time)  # a traced request's step starts here (StepTime)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)
