"""A step's KV transfers: planned by the prefill connector, carried to the worker in the engine's step
message, passed by the worker to the cache messager with one signal per finished layer. Torch-free and
below engine, worker and disagg alike, so all three import it and none imports another for it."""

from __future__ import annotations

import msgspec

from pdserve.transport import Endpoint


class TransferPlan(msgspec.Struct, array_like=True):
    """This step's share of one request's transfer: after each layer, write that layer of
    `src_blocks` into D's `dst_blocks`; before the first layer, whole blocks for the first
    `num_whole_blocks` pairs (a prefix-cache hit on P: computed earlier, never by this step)."""

    transfer_id: str
    endpoint: Endpoint
    src_blocks: list[int]
    dst_blocks: list[int]
    num_whole_blocks: int
    last: bool  # the request's final chunk: report TransferDone after its last layer
    deadline: float  # unix time; D frees the blocks after its lease, so nothing may be written later


class StepTransfers(msgspec.Struct, tag=True):
    step_id: int
    transfers: list[TransferPlan]


class LayerDone(msgspec.Struct, tag=True):
    step_id: int
    layer: int
    rank: int = 0  # the tensor-parallel rank whose heads of the layer are done


MessagerInput = StepTransfers | LayerDone


