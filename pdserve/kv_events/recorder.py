"""The engine's side: the prefix cache (block_pool.py, host_tier.py, kv_cache_manager.py) records each
change here as it makes it, and the engine loop takes the step's events to publish them as one batch."""

from __future__ import annotations

from pdserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVEventRecorder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], medium: str,
               lora_name: str | None = None) -> None:
        """`lora_name`: the adapter the blocks were computed under (their hashes are keyed by it)."""
        if not block_hashes:
            return
        last = self._events[-1] if self._events else None
        if (not token_ids and parent is None and isinstance(last, BlockStored) and last.medium == medium
                and not last.token_ids and last.parent_block_hash is None and last.lora_name == lora_name):
            last.block_hashes.extend(block_hashes)  # blocks saved one by one to the host tier: one event
        else:
            self._events.append(BlockStored(list(block_hashes), parent, list(token_ids), self.block_size, None,
                                            medium, lora_name))

    def removed(self, block_hash: bytes, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)  # an eviction run is one event
        else:
            self._events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # what came before it in this step no longer matters

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
