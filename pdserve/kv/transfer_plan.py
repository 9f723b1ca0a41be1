"""A step's KV transfers: planned by the prefill connector, carried to the worker in the engine's step
message, passed by the worker to the cache messager with one signal per finished layer. Torch-free and
below engine, worker and disagg alike, so all three import it and none imports another for it."""

from __future__ import annotations

import msgspec

from pdserve.transport import Endpoint


class BlockPairs(msgspec.Struct, array_like=True):
    """One layer group's blocks in a transfer: P's `src_blocks` go into D's `dst_blocks`, the first
    `num_whole_blocks` pairs whole before the first layer (computed earlier, never by this step)."""

    src_blocks: list[int]
    dst_blocks: list[int]
    num_whole_blocks: int


class TransferPlan(msgspec.Struct, array_like=True):
    """This step's share of one request's transfer: after each layer, write that layer of
    `src_blocks` into D's `dst_blocks`; before the first layer, whole blocks for the first
    `num_whole_blocks` pairs (a prefix-cache hit on P: computed earlier, never by this step).
    With layer groups (config/layer_groups.py) those are group 0's blocks and `group_pairs` the
    other groups': a layer's blocks are its group's."""

    transfer_id: str
    endpoint: Endpoint
    src_blocks: list[int]
    dst_blocks: list[int]
    num_whole_blocks: int
    last: bool  # the request's final chunk: report TransferDone after its last layer
    deadline: float  # unix time; D frees the blocks after its lease, so nothing may be written later
    group_pairs: list[BlockPairs] = []  # layer groups 1..; empty with one block table for every layer

    def group(self, g: int) -> BlockPairs:
        """Layer group g's blocks."""
        if g == 0:
            return BlockPairs(self.src_blocks, self.dst_blocks, self.num_whole_blocks)
        return self.group_pairs[g - 1]

    @property
    def groups(self) -> list[BlockPairs]:
        return [self.group(0), *self.group_pairs]


class StepTransfers(msgspec.Struct, tag=True):
    step_id: int
    transfers: list[TransferPlan]


class LayerDone(msgspec.Struct, tag=True):
    step_id: int
    layer: int
    rank: int = 0  # the tensor-parallel rank whose heads of the layer are done


MessagerInput = StepTransfers | LayerDone


