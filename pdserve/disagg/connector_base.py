"""What the prefill and decode connectors share: transfer figures, the prompt digest, failing a request."""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Callable

from pdserve.config.engine import EngineConfig
from pdserve.engine.messages import RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.request_output import error_output
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stats import PDStats
from pdserve.http.errors import PD_ERROR
from pdserve.kv.layout import KVLayout

log = logging.getLogger("pdserve.pd")


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:16]


class ConnectorBase:
    port: int | None = None  # the control plane peers reach (a prefill instance sets it)

    def __init__(self, config: EngineConfig, scheduler: Scheduler, layout: KVLayout,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.scheduler = scheduler
        self.layout = layout
        self.clock = clock  # time.time; tests pass a fake one
        self.transfer_stats = PDStats()  # only grows; `stats` sends a copy

    def during_step(self) -> None:
        """Nothing by default; the prefill side renews D's leases (see PrefillConnector)."""

    def _fail_request(self, request: Request, error: str) -> RequestOutput:
        self.transfer_stats.transfers_failed += 1
        log.warning("request %s: %s", request.request_id, error)
        return error_output(request, f"PD error: {error}", error_type=PD_ERROR)
