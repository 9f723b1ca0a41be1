"""GET /cluster: the deployment as this router sees it, for live views (`pdserve top`) and scripts: the router's
last minute, and every registered member with the router's view of it (role, health, requests in flight, restarts)
beside the member's own GET /status (queue, KV use by tier, its last minute's TTFT and ITL, refusals)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp

from pdserve.router.registry import Instance
from pdserve.utils.recent import RecentEvents

STATUS_TIMEOUT_S = 1.0  # a member that does not answer within this is shown with the error


@dataclass
class RecentAnswers:
    """The router's last minute: requests answered, refused by admission (429), failed (5xx)."""

    answered: RecentEvents = field(default_factory=RecentEvents)
    refused: RecentEvents = field(default_factory=RecentEvents)
    failed: RecentEvents = field(default_factory=RecentEvents)

    def add(self, status: int) -> None:
        self.answered.add()
        if status == 429:
            self.refused.add()
        elif status >= 500:
            self.failed.add()

    def summary(self) -> dict:
        return {"window_s": self.answered.window, "requests": self.answered.count(),
                "refused": self.refused.count(), "failed": self.failed.count()}


async def member_status(client: aiohttp.ClientSession, instance: Instance) -> dict:
    try:
        async with client.get(f"{instance.url}/status", timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}"}
            return json.loads(await r.read())
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return {"error": str(e) or type(e).__name__}


async def cluster_view(client: aiohttp.ClientSession, members: list[Instance], router: dict) -> dict:
    statuses = await asyncio.gather(*(member_status(client, m) for m in members))
    return {"router": router,
            "members": [{**_registered(m), "status": s} for m, s in zip(members, statuses, strict=True)]}


def _registered(m: Instance) -> dict:
    d = m.as_dict()
    keep = ("url", "role", "model", "healthy", "draining", "in_flight_requests", "in_flight_tokens", "served",
            "failed", "restarts", "seconds_since_heartbeat", "pd_sides", "host_id")
    return {k: d.get(k) for k in keep}
