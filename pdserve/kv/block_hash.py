"""The chained block hash that the engine's prefix cache, the KV events and the routers' prefix index must agree
on: one definition, below all three."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Iterable[int]) -> BlockHash:
    """Chained hash: a block's identity covers its tokens and every token before it.

    SHA-256, not Python's hash(): a client must not be able to craft a block that collides with
    another user's prefix and have its KV served to them (cache poisoning, as in vLLM's CVE-2025-25183).
    """
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()
