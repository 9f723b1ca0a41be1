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


def chained_hashes(token_ids: list[int], block_size: int, root: BlockHash | None = None) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids`, the first one's parent `root` (a LoRA adapter's:
    config/lora.lora_hash_root): what the engine's prefix cache holds once these tokens are computed."""
    hashes: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else root, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
