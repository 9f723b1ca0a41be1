"""The data-parallel ranks of one API server (`--data-parallel-size N`): N engines, each with its own scheduler,
KV cache and workers (tensor-parallel ones too, if asked), behind one HTTP server, with AsyncEngine's face.

A request goes to the rank the caller named (the `/dp/R/` path prefix: in PD roles each rank registers with the
router as its own prefill or decode endpoint, with its own control-plane port) or, unnamed, to the rank the
router's cache-aware policy picks (prefix affinity, least in-flight prompt tokens when loads are uneven). A rank
whose engine dies is started again while the others serve; its requests in flight fail (a router resumes their
streams elsewhere). Only ranks that keep dying take the server down (exit 1, for its supervisor).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar

from pdserve.admission.load import LoadReport
from pdserve.api.async_engine import AsyncEngine
from pdserve.balancing.policies import CacheAware, RoutedRequest
from pdserve.config.engine import EngineConfig
from pdserve.engine.engine_client import EngineClient, EngineError
from pdserve.engine.messages import EngineReady, GetStats, PDParams, RequestOutput, Utility
from pdserve.engine.prefix_pull import PullHint
from pdserve.engine.stats import EngineStats
from pdserve.sampling import SamplingParams

log = logging.getLogger("pdserve.serve")

# The rank a request named (the /dp/R/ path prefix, set by DataParallelPrefix); None: the balancer picks.
ROUTED_RANK: ContextVar[int | None] = ContextVar("routed_rank", default=None)
RESTARTS_PER_WINDOW, RESTART_WINDOW_S = 5, 300.0  # more deaths than this in the window: a crash loop


class EngineRank:
    """One rank, as the balancing policies see an endpoint."""

    def __init__(self, rank: int, config: EngineConfig, engine: AsyncEngine) -> None:
        self.rank, self.config, self.engine = rank, config, engine
        self.in_flight_requests = 0
        self.in_flight_tokens = 0
        self.served = 0
        self.restarts: list[float] = []  # when its engine was started again
        self.restarting = False

    @property
    def in_flight_prefill_tokens(self) -> int:
        return self.in_flight_tokens  # the server does not follow first tokens: every prompt counts as queued

    @property
    def url(self) -> str:
        return f"dp/{self.rank}"

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def healthy(self) -> bool:
        return not self.restarting and self.engine.healthy


class DataParallelEngine:
    data_parallel = True

    def __init__(self, ranks: list[EngineRank], start_client: Callable[[EngineConfig, int], EngineClient]) -> None:
        self.ranks = ranks
        self._start_client = start_client  # (config, rank) -> an EngineClient whose process has started
        self.policy = CacheAware()
        self.dead = asyncio.Event()  # set when a rank crash-loops: the server stops
        self._error: str | None = None
        self._where: dict[str, EngineRank] = {}
        self._watchers: list[asyncio.Task] = []

    # ---- AsyncEngine's face ----------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        routed = ROUTED_RANK.get()
        if self._error is not None:
            return False
        if routed is not None:
            return self.ranks[routed].healthy
        return any(r.healthy for r in self.ranks)

    @property
    def error(self) -> str | None:
        if self._error is not None:
            return self._error
        routed = ROUTED_RANK.get()
        if routed is not None and not self.ranks[routed].healthy:
            return f"data-parallel rank {routed} is restarting" if self.ranks[routed].restarting else \
                self.ranks[routed].engine.error
        return None if any(r.healthy for r in self.ranks) else "every data-parallel rank is down"

    def start(self) -> None:
        for rank in self.ranks:
            rank.engine.start()
        loop = asyncio.get_running_loop()
        self._watchers = [loop.create_task(self._watch(rank)) for rank in self.ranks]

    async def stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for rank in self.ranks:
            await rank.engine.stop()

    def close(self) -> None:
        for rank in self.ranks:
            rank.engine.client.close()

    @property
    def ready(self) -> EngineReady:
        return self.ranks[0].engine.client.ready

    def load_reports(self) -> list[LoadReport | None]:
        return [r.engine.load for r in self.ranks]

    def rank_clients(self) -> list[tuple[int, EngineClient]]:
        return [(r.rank, r.engine.client) for r in self.ranks]

    def rank_counts(self) -> list[tuple[int, int, int]]:
        """(rank, requests sent to it, restarts) of each rank."""
        return [(r.rank, r.served, len(r.restarts)) for r in self.ranks]

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_ids: list[int], pd: PDParams | None = None, num_resumed: int = 0,
                       priority: int = 0, lora_name: str | None = None,
                       kv_pull: PullHint | None = None, trace_steps: bool = False) -> AsyncIterator[RequestOutput]:
        rank = self._pick(prompt_token_ids)
        rank.in_flight_requests += 1
        rank.in_flight_tokens += len(prompt_token_ids)
        rank.served += 1
        self._where[request_id] = rank
        try:
            async for out in rank.engine.generate(request_id, prompt_token_ids, params, eos_token_ids, pd,
                                                  num_resumed, priority, lora_name, kv_pull, trace_steps):
                yield out
        finally:
            rank.in_flight_requests -= 1
            rank.in_flight_tokens -= len(prompt_token_ids)
            self._where.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if (rank := self._where.get(rid)) is not None:
                by_rank.setdefault(rank.rank, []).append(rid)
        for r, ids in by_rank.items():
            await self.ranks[r].engine.abort(ids)

    async def call(self, utility: Utility, timeout: float = 10.0) -> dict:
        """Every rank's utility call (clearing and loading weights: the server's weights, whichever path it came
        by), their counts summed."""
        results = [await r.engine.call(utility, timeout) for r in self.ranks]
        merged: dict = {}
        for result in results:
            for key, value in result.items():
                merged[key] = merged.get(key, 0) + value if isinstance(value, int | float) else value
        return merged

    async def stats_by_rank(self) -> list[tuple[int, EngineStats | None]]:
        out = []
        for r in self.ranks:
            try:
                out.append((r.rank, await r.engine.call(GetStats()) if r.healthy else None))
            except (EngineError, TimeoutError):
                out.append((r.rank, None))
        return out

    # ---- internals -----------------------------------------------------------------------------------

    def _pick(self, prompt_token_ids: list[int]) -> EngineRank:
        routed = ROUTED_RANK.get()
        if routed is not None:
            rank = self.ranks[routed]
            if not rank.healthy:
                raise EngineError(self.error or f"data-parallel rank {routed} is down", "service_unavailable")
            return rank
        candidates = [r for r in self.ranks if r.healthy]
        if not candidates:
            raise EngineError("every data-parallel rank is down", "service_unavailable")
        return self.policy.choose(candidates, RoutedRequest(prompt_token_ids, len(prompt_token_ids)))

    async def _watch(self, rank: EngineRank) -> None:
        """Start a rank again when its engine dies; a crash loop stops the server."""
        while True:
            await rank.engine.dead.wait()
            now = time.monotonic()
            rank.restarts = [t for t in rank.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(rank.restarts) > RESTARTS_PER_WINDOW:
                self._error = (f"data-parallel rank {rank.rank} died {len(rank.restarts)} times in "
                               f"{RESTART_WINDOW_S:.0f} s: {rank.engine.error}")
                self.dead.set()
                return
            log.error("data-parallel rank %d died (%s): starting it again; the other ranks keep serving",
                      rank.rank, rank.engine.error)
            rank.restarting = True
            try:
                await rank.engine.stop()
                await asyncio.to_thread(rank.engine.client.close)
                while True:
                    # started from this (the server's lasting) thread: the engine's parent-death signal
                    # follows the thread that started it; only the wait for it runs elsewhere
                    client = self._start_client(rank.config, rank.rank)
                    try:
                        await asyncio.to_thread(client.wait_ready)
                        break
                    except EngineError as e:
                        log.error("data-parallel rank %d did not start again (%s); retrying in 5 s", rank.rank, e)
                        await asyncio.sleep(5)
                rank.engine = AsyncEngine(client)
                rank.engine.start()
                log.info("data-parallel rank %d serves again", rank.rank)
            finally:
                rank.restarting = False


class DataParallelPrefix:
    """ASGI middleware: `/dp/R/...` is `...` served by rank R (the router's address of a rank's endpoint)."""

    def __init__(self, app: object, ranks: int) -> None:
        self.app, self.ranks = app, ranks

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/dp/"):
            head, _, rest = path[4:].partition("/")
            if head.isdigit() and int(head) < self.ranks:
                token = ROUTED_RANK.set(int(head))
                try:
                    await self.app({**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode()}, receive, send)
                finally:
                    ROUTED_RANK.reset(token)
                return
        await self.app(scope, receive, send)
