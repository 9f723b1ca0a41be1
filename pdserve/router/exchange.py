"""One request's exchange with one instance: counted as the instance's load, ended at once when the
registry loses the instance, its bytes relayed through a queue, its late responses closed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import aiohttp

from pdserve.router.registry import Instance, InstanceLost, Registry

# The instance, not the request, is at fault. (The client is aiohttp: httpx's connection pool costs
# milliseconds per request at a few dozen connections, which would be most of the router's time.)
BROKEN = (aiohttp.ClientError, TimeoutError, InstanceLost)


class Exchange:
    """One request's exchange with one instance, counted as its load, ended at once if it is lost."""

    def __init__(self, registry: Registry, instance: Instance, tokens: int, prefill_tokens: int = 0) -> None:
        """`prefill_tokens`: what the instance computes of the prompt, counted until prefilled() or close()."""
        self.registry, self.instance = registry, instance
        self._prefill = prefill_tokens
        instance.in_flight_prefill_tokens += prefill_tokens
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._tracking = registry.track(instance, tokens, self._on_lost)
        self._tracking.__enter__()
        self._open = True

    def _on_lost(self, reason: str) -> None:
        if not self.lost.done():
            self.lost.set_result(reason)

    def prefilled(self) -> None:
        """The first token came: the prompt no longer waits to be computed there."""
        self.instance.in_flight_prefill_tokens -= self._prefill
        self._prefill = 0

    def close(self) -> None:
        if self._open:
            self._open = False
            self.prefilled()
            self._tracking.__exit__(None, None, None)

    async def guard(self, awaitable: Awaitable):  # noqa: ANN201
        """Await it, unless the instance is lost first (InstanceLost)."""
        task = asyncio.ensure_future(awaitable)
        if self.lost.done():
            task.cancel()
        else:
            try:
                await asyncio.wait({task, self.lost}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                task.add_done_callback(close_late_response)
                raise
            if task.done():
                return task.result()
            task.cancel()
        task.add_done_callback(close_late_response)
        raise InstanceLost(f"{self.instance.role} instance {self.instance.url} left the pool: {self.lost.result()}")

    async def chunks(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        it = response.content.iter_any().__aiter__()
        while True:
            try:
                chunk = await self.guard(it.__anext__())
            except StopAsyncIteration:
                return
            yield chunk

    def broken(self, error: BaseException) -> None:
        """A transport error: take the instance out of the pool now, so other requests avoid it too.
        A timeout is not one: a long answer may simply outlast --request-timeout; probes judge."""
        if not isinstance(error, InstanceLost | TimeoutError):
            self.registry.probe_failed(self.instance, f"a request failed: {type(error).__name__}: {error}",
                                       at_once=True)
        self.instance.failed += 1


def close_late_response(task: asyncio.Task) -> None:
    """For an awaitable nobody waits for any more: close the response it produced, or read its error."""
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), aiohttp.ClientResponse):
        task.result().close()


async def pump(chunks: AsyncIterator[bytes], queue: asyncio.Queue) -> BaseException | None:
    """Copy the chunks into `queue`, then None; a failure goes in as an exception and is returned."""
    try:
        async for chunk in chunks:
            await queue.put(chunk)
    except BROKEN as e:
        await queue.put(e)
        return e
    finally:
        await queue.put(None)
    return None


async def next_chunk(queue: asyncio.Queue) -> bytes | None:
    item = await queue.get()
    if isinstance(item, BaseException):
        raise item
    return item


async def drain(queue: asyncio.Queue) -> AsyncIterator[bytes]:
    while (item := await next_chunk(queue)) is not None:
        yield item


async def cancel_response(task: asyncio.Task) -> None:
    """Cancel a pending `client.send`, or close the response it already produced."""
    task.cancel()
    try:
        response = await task
    except (asyncio.CancelledError, *BROKEN):
        # Also swallows a cancellation of our own caller, which is already unwinding (this runs in
        # `finally` blocks); `cancelling()` cannot tell the two apart there.
        return
    response.close()
