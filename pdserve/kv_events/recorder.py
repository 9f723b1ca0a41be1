"""The engine's side: the prefix cache (block_pool.py, host_tier.py, kv_cache_manager.py) records each
change here as it makes it, and the engine loop takes the step's events to publish them as one batch.

With layer groups (config/layer_groups.py) each group's blocks are events of their own, under the token hashes and
with the group's index, kind and window (vLLM's fields): a router keeps the full-attention group's."""

from __future__ import annotations

from pdserve.config.layer_groups import LayerGroups, split_group_key
from pdserve.kv_events.events import (
    FULL_ATTENTION,
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


class KVEventRecorder:
    def __init__(self, block_size: int, groups: LayerGroups | None = None) -> None:
        self.block_size = block_size
        self.groups = groups
        self._events: list[KVEvent] = []

    def stored(self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], medium: str,
               lora_name: str | None = None, group: int = 0) -> None:
        """`lora_name`: the adapter the blocks were computed under (their hashes are keyed by it); `group`: the
        layer group whose blocks these are."""
        if not block_hashes:
            return
        last = self._events[-1] if self._events else None
        event = BlockStored(list(block_hashes), parent, list(token_ids), self.block_size, None, medium, lora_name,
                            None, *self._spec(group))
        if (not token_ids and parent is None and isinstance(last, BlockStored) and not last.token_ids
                and last.parent_block_hash is None
                and (last.medium, last.lora_name, last.group_idx) == (medium, lora_name, event.group_idx)):
            last.block_hashes.extend(block_hashes)  # blocks saved one by one to the host tier: one event
        else:
            self._events.append(event)

    def stored_key(self, key: bytes, medium: str) -> None:
        """A block under a prefix cache key (config/layer_groups.group_key) became readable, its tokens not kept
        (a lower tier's, or one copied up from it)."""
        group, block_hash = split_group_key(key)
        self.stored([block_hash], None, [], medium, group=group)

    def removed(self, key: bytes, medium: str) -> None:
        """A prefix cache key (config/layer_groups.group_key) is gone."""
        group, block_hash = split_group_key(key)
        group_idx = self._spec(group)[0]
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and (last.medium, last.group_idx) == (medium, group_idx):
            last.block_hashes.append(block_hash)  # an eviction run is one event
        else:
            self._events.append(BlockRemoved([block_hash], medium, group_idx))

    def _spec(self, group: int) -> tuple[int | None, str | None, int | None]:
        """(group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window): all None with one group."""
        if self.groups is None:
            return None, None, None
        window = self.groups.windows[group]
        return group, SLIDING_WINDOW if window else FULL_ATTENTION, window or None

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # what came before it in this step no longer matters

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
