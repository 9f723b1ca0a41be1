"""The client's stream: events as they come; when the instance fails mid-answer, the rest from another route
(migration.py says where the client is), else an error event."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from pdserve.http.errors import PD_ERROR, error_body
from pdserve.router.exchange import BROKEN
from pdserve.router.migration import AnswerSoFar
from pdserve.router.outcome import Opened, Outcome, response_message
from pdserve.router.registry import Instance
from pdserve.router.sse import DONE, error_event, server_error, take_token_ids

if TYPE_CHECKING:
    from pdserve.router.tracing import RequestTrace

log = logging.getLogger("pdserve.router")


class StreamRelay:
    def __init__(self, answer: AnswerSoFar, resume: Callable[[], Awaitable[Outcome]],
                 on_migration: Callable[[bool, float], None], trace: RequestTrace | None) -> None:
        self.answer = answer
        self.resume = resume  # the rest of the answer from another route
        self.on_migration = on_migration
        self.trace = trace
        self.failure: str | None = None  # why the current leg ended, if it failed

    async def events(self, opened: Opened) -> AsyncIterator[bytes]:
        current: Opened | None = opened
        try:
            while current is not None:
                async for event in self._leg(current):
                    yield event
                if self.failure is None:
                    return
                instance, current = current.ex.instance, None
                if self.answer.finished:  # only the usage chunk can be missing
                    yield DONE
                    return
                if not self.answer.can_resume:
                    yield error_event(error_body(f"PD error: {self.failure}", 502, PD_ERROR))
                    return
                outcome = await self._migrate(instance)
                if not isinstance(outcome, Opened):
                    yield error_event(error_body(f"PD error: {self.failure}; resuming it elsewhere failed: "
                                                 f"{response_message(outcome)}", 502, PD_ERROR))
                    return
                current = outcome
        finally:
            if current is not None:
                current.close()

    async def _leg(self, current: Opened) -> AsyncIterator[bytes]:
        """One route's events until it ends or fails (`failure` says why); the leg is closed after."""
        self.failure = None
        try:
            async for raw_event in current.events():
                event, token_ids = take_token_ids(raw_event)
                self.failure = server_error(event)
                if self.failure is not None:
                    break
                self.answer.saw(event, token_ids)
                yield event
        except BROKEN as e:
            current.ex.broken(e)
            self.failure = f"the {current.ex.instance.role} instance {current.ex.instance.url} failed mid-answer: {e}"
        finally:
            current.close(self.failure)

    async def _migrate(self, instance: Instance) -> Outcome:
        answer = self.answer
        answer.failed_on(instance)
        log.warning("resuming a stream after %d tokens without %s: %s", len(answer.token_ids), instance.url,
                    (self.failure or "")[:200])
        began = time.monotonic()
        outcome = await self.resume()
        took = time.monotonic() - began
        self.on_migration(isinstance(outcome, Opened), took)
        resumed_on = outcome.ex.instance.url if isinstance(outcome, Opened) else None
        if self.trace is not None:
            self.trace.migrated(instance.url, len(answer.token_ids), resumed_on)
        if resumed_on is not None:
            log.info("resumed a stream after %d tokens on %s in %.3f s", len(answer.token_ids), resumed_on, took)
        return outcome
