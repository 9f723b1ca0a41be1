"""An instance announces itself to the router (`--router URL`) every few seconds, and leaves on stop.

Each registration is a heartbeat; the body is signed with the cluster secret (cluster_auth) so the
router admits only members of its deployment.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from pdserve.http.members import post_signed

log = logging.getLogger("pdserve.registration")

INTERVAL = 2.0  # seconds; the router drops an instance it has not heard from in a few intervals
RETRY = 0.5  # seconds between tries while the router cannot be reached


async def register_forever(router_url: str, instance: dict, interval: float = INTERVAL) -> None:
    url = router_url.rstrip("/")
    async with httpx.AsyncClient(timeout=5.0) as client:
        failing = False
        try:
            while True:
                try:
                    r = await post_signed(client, url, "/register", instance)
                    if r.status_code in (401, 403):
                        raise httpx.HTTPError(f"refused: {r.text[:300]}")
                    r.raise_for_status()
                    if failing:
                        log.info("registered with the router at %s again", url)
                    failing = False
                except httpx.HTTPError as e:
                    if not failing:
                        log.warning("cannot register with the router at %s: %s (retrying every %g s)", url, e,
                                    min(interval, RETRY))
                    failing = True
                await asyncio.sleep(min(interval, RETRY) if failing else interval)  # a restarted router: rejoin fast
        finally:
            try:
                await post_signed(client, url, "/unregister", {"url": instance["url"]}, timeout=1.0)
            except (httpx.HTTPError, asyncio.CancelledError):
                pass
