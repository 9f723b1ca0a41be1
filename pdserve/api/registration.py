"""An instance announces itself to the router (`--router URL`) every few seconds, and leaves on stop."""

from __future__ import annotations

import asyncio
import logging

import httpx

log = logging.getLogger("pdserve.registration")

INTERVAL = 2.0  # seconds; the router drops an instance it has not heard from in a few intervals


async def register_forever(router_url: str, instance: dict, interval: float = INTERVAL) -> None:
    url = router_url.rstrip("/")
    async with httpx.AsyncClient(timeout=5.0) as client:
        failing = False
        try:
            while True:
                try:
                    (await client.post(f"{url}/register", json=instance)).raise_for_status()
                    if failing:
                        log.info("registered with the router at %s again", url)
                    failing = False
                except httpx.HTTPError as e:
                    if not failing:
                        log.warning("cannot register with the router at %s: %s (retrying every %g s)", url, e,
                                    interval)
                    failing = True
                await asyncio.sleep(interval)
        finally:
            try:
                await client.post(f"{url}/unregister", json={"url": instance["url"]}, timeout=1.0)
            except (httpx.HTTPError, asyncio.CancelledError):
                pass
