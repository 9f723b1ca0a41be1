"""Layer groups: which layers of a model share a block table, for models that mix sliding-window and full attention.

A sliding-window layer needs only its window's keys, so its blocks can be given back as the sequence moves on,
while a full-attention layer keeps every block. With one block table for all layers, no block could ever go: every
block also holds the full-attention layers' keys. So layers are grouped by the window they attend with, each group
with its own block table, and every group holds the same number of layers (the smallest attention kind's count), so
that a block of the cache, one layer "slot" per group member, serves any group: one pool of equal blocks, no
partition to size in advance. Gemma 3 270M (18 layers, 3 of them global): 6 groups of 3 layers, the global one and
five sliding ones; a 4k-token request holds 256 blocks in the global group and ~33 in each sliding one, 421 where one
table for all layers would hold 6 x 256. A group smaller than the rest leaves its last slots unused.

A model without windows has one group of every layer: the block table, slots and bytes of before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pdserve.config.model import ModelConfig


class LayerGroups(msgspec.Struct, frozen=True):
    layers: tuple[tuple[int, ...], ...]  # each group's layers, a layer's slot is its index in the group
    windows: tuple[int, ...]  # each group's sliding window in tokens; 0: full attention

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> LayerGroups:
        return cls((tuple(range(num_layers)),), (window,))

    @classmethod
    def by_window(cls, layer_windows: tuple[int, ...]) -> LayerGroups:
        """Layers grouped by their window (full attention first), in groups as large as the fewest layers of one
        window; one group where every layer has the same window."""
        kinds: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1:
            (window,) = kinds
            return cls.single(len(layer_windows), window)
        size = min(len(layers) for layers in kinds.values())
        groups = [(window, tuple(layers[i:i + size])) for window, layers in sorted(kinds.items())
                  for i in range(0, len(layers), size)]
        return cls(tuple(g for _, g in groups), tuple(w for w, _ in groups))

    @property
    def slots(self) -> int:
        """Layer slots per block: the largest group's layers."""
        return max(len(g) for g in self.layers)

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a model layer."""
        for group, layers in enumerate(self.layers):
            if layer in layers:
                return group, layers.index(layer)
        raise ValueError(f"layer {layer} is in no group of {self.layers}")

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one request of `num_tokens` holds across the groups, prompt chunks of at most `chunk`
        tokens (a chunk's keys are written before its queries drop the window's earlier blocks)."""
        total = -(-num_tokens // block_size)
        return sum(min(total, (window + chunk - 1) // block_size + 2) if window else total for window in self.windows)

    def first_live_block(self, group: int, next_position: int, block_size: int) -> int:
        """The first block a query at `next_position` or later can see in this group (0 for full attention)."""
        window = self.windows[group]
        if window == 0:
            return 0
        return max(0, next_position - window + 1) // block_size


HASH_BYTES = 32  # a block hash (kv/block_hash.py: SHA-256)


def group_key(group: int, block_hash: bytes) -> bytes:
    """The prefix cache's key for a block of layer group `group` (> 0): blocks of the same tokens in different
    groups hold different layers' K/V; group 0's key is the hash itself."""
    return block_hash + bytes([group]) if group else block_hash


def split_group_key(key: bytes) -> tuple[int, bytes]:
    """(group, block hash) of a prefix cache key (group_key)."""
    return (key[-1], key[:-1]) if len(key) == HASH_BYTES + 1 else (0, key)


def layer_groups_for(model: ModelConfig, one_table_reason: str | None) -> LayerGroups | None:
    """The model's layer groups, or None where it keeps one block table for every layer: a model without
    sliding-window layers, one without full-attention layers, or an instance with a reason to
    (EngineConfig.one_block_table_reason)."""
    if not model.has_windows or one_table_reason is not None:
        return None
    groups = LayerGroups.by_window(model.layer_windows)
    return groups if groups.num_groups > 1 and groups.windows[0] == 0 else None
