"""Mid-answer migration (Dynamo's request migration): what the router keeps of a stream so that,
when the instance streaming it dies, another one continues it where the client is.

The router asks instances to name each event's token ids (the `migration` field, http/wire.py).
After a failure it sends the same request again with those tokens (`migration.token_ids`) and the
stream's id: the new instance computes prompt + tokens as its prompt, counts the tokens as output
(max_tokens, usage, penalties, the grammar, a seed's draws), settles their text as the first instance
did (stop strings, held-back text), and streams on without a role chunk. Greedy answers therefore
equal an unbroken run. One choice (n = 1) on /v1/completions and /v1/chat/completions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from pdserve.balancing.policies import RoutedRequest
from pdserve.router.registry import Instance, Registry

MIGRATING_PATHS = ("/v1/completions", "/v1/chat/completions")


def can_migrate(path: str, body: dict, limit: int) -> bool:
    return limit > 0 and bool(body.get("stream")) and path in MIGRATING_PATHS and body.get("n", 1) in (1, None)


@dataclass
class AnswerSoFar:
    """What the client has of one streamed answer."""

    limit: int  # migrations left
    token_ids: list[int] = field(default_factory=list)
    stream_id: str | None = None
    created: int | None = None
    finished: bool = False  # a choice's finish reason went out: only usage and [DONE] may follow
    migrations: int = 0
    failed: dict[str, int | None] = field(default_factory=dict)  # url -> pid of the process that failed it

    def failed_on(self, instance: Instance) -> None:
        self.failed[instance.url] = instance.info.pid

    def excluded(self, registry: Registry) -> set[str]:
        """Instances not to resume on: those that failed this answer, unless restarted since (a new pid)."""
        pids = {i.url: i.info.pid for i in registry.all()}
        return {url for url, pid in self.failed.items() if pids.get(url, pid) == pid}

    def saw(self, event: bytes, token_ids: list[int] | None) -> None:
        if token_ids:
            self.token_ids += token_ids
        if self.stream_id is None and event.startswith(b"data: {"):
            try:
                data = json.loads(event[len(b"data: "):])
                self.stream_id, self.created = data.get("id"), data.get("created")
            except ValueError:
                pass
        if b'"finish_reason": "' in event:
            self.finished = True

    @property
    def can_resume(self) -> bool:
        return self.migrations < self.limit

    def resumed_body(self, body: dict) -> dict:
        self.migrations += 1
        return {**body, "migration": {"token_ids": self.token_ids, "id": self.stream_id, "created": self.created}}

    def resumed_request(self, request: RoutedRequest) -> RoutedRequest:
        """The routing view of the resumed request: its prompt is the old one plus the tokens so far."""
        ids = None if request.token_ids is None else request.token_ids + self.token_ids
        return replace(request, token_ids=ids, num_tokens=request.num_tokens + len(self.token_ids), _hashes={})
