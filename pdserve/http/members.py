"""How members of a deployment reach each other over HTTP: routers' URLs as flags give them, and a POST signed
with the cluster secret (registrations, role changes), which the receiver checks with cluster_auth."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pdserve.utils.cluster_auth import SIGNATURE_HEADER, cluster_secret, sign_body

if TYPE_CHECKING:
    import httpx


def router_url(text: str) -> str:
    return text if "://" in text else f"http://{text}"


def router_urls(text: str) -> list[str]:
    return [router_url(t.strip()) for t in text.split(",") if t.strip()]


async def post_signed(client: httpx.AsyncClient, base: str, path: str, payload: dict,
                      **kwargs: object) -> httpx.Response:
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign_body(cluster_secret(), path, body)}
    return await client.post(f"{base}{path}", content=body, headers=headers, **kwargs)
