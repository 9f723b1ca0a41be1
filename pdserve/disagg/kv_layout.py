"""Where a block's KV lives in the cache buffer, as byte ranges: the only module that knows the layout.

The transports move byte ranges between two cache buffers and know nothing of layers or blocks
(SGLang's transfer arguments grew model-specific fields; ours stay `(src, dst, nbytes)`).
Layout `[num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]` (see kv_cache.py): one
layer of one block is one contiguous region, and a whole block is too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from pdserve.disagg.transport.base import ByteRange

if TYPE_CHECKING:  # torch stays out of the processes that only pass layouts around (API server, engine)
    from pdserve.kv_cache import KVCacheSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the cache dtypes (--kv-cache-dtype)


class KVLayout(msgspec.Struct, frozen=True):
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"

    @classmethod
    def of(cls, spec: KVCacheSpec) -> KVLayout:
        return cls(spec.num_blocks, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim,
                   str(spec.dtype).removeprefix("torch."))

    def spec(self) -> KVCacheSpec:
        import torch

        from pdserve.kv_cache import KVCacheSpec

        return KVCacheSpec(self.num_blocks, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                           getattr(torch, self.dtype))

    def same_geometry(self, other: KVLayout) -> bool:
        """Everything but the block count must agree for P's blocks to be D's blocks."""
        return msgspec.structs.replace(self, num_blocks=0) == msgspec.structs.replace(other, num_blocks=0)

    def compatibility_key(self, model: str) -> str:
        """What a P and a D must share to be paired: the model and every layout field but the block count."""
        return (f"{model}|block={self.block_size}|dtype={self.dtype}|layers={self.num_layers}"
                f"|kv_heads={self.num_kv_heads}|head_dim={self.head_dim}")

    @property
    def layer_block_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


def layer_ranges(layout: KVLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int], layer: int) -> list[ByteRange]:
    """One layer of each block pair (regions of different blocks are never adjacent)."""
    lb, bb = layout.layer_block_bytes, layout.block_bytes
    return [(s * bb + layer * lb, d * bb + layer * lb, lb) for s, d in zip(src_blocks, dst_blocks, strict=True)]


def block_ranges(layout: KVLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[ByteRange]:
    """Whole blocks (every layer), runs of adjacent blocks on both sides merged into one range."""
    bb = layout.block_bytes
    return coalesce((s * bb, d * bb, bb) for s, d in zip(src_blocks, dst_blocks, strict=True))


def coalesce(ranges: Iterable[ByteRange]) -> list[ByteRange]:
    out: list[ByteRange] = []
    for src, dst, n in ranges:
        if out:
            ps, pd, pn = out[-1]
            if ps + pn == src and pd + pn == dst:
                out[-1] = (ps, pd, pn + n)
                continue
        out.append((src, dst, n))
    return out
