"""The KV cache's layout, and where a block's KV lives in it as byte ranges: the only module that knows it.

`[num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]`, block-major: one layer of one block is one
contiguous region, and a whole block is too. An 8-bit cache (`--kv-cache-dtype fp8|fp8_e5m2|int8`) keeps the
same order in bytes: a layer of a block is its K and V codes (one byte per element, in the order above) followed
by their scales, one bf16 per (K or V, token, KV head), `[2, block_size, kv_heads]`; so a layer of a block is
still one region and every path that moves blocks moves the 8-bit bytes as they are. It is the instance's
layout, every KV head of the model, whatever the tensor-parallel size: a rank computes with its heads' share
(`rank_share`), a strided view of the same memory (or, in device memory, a cache of its own copied through host
memory of this layout), so a P and a D of different TP sizes exchange the same byte ranges. The cache
(kv/cache.py) is allocated from this description, the engine and the cache service pass it around (it is
torch-free msgspec), and the transfers turn it into byte ranges. The transports move byte ranges between two cache
buffers and know nothing of layers or blocks (SGLang's transfer arguments grew model-specific fields; ours stay
`(src, dst, nbytes)`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.config.layer_groups import LayerGroups
from pdserve.transport.base import ByteRange
from pdserve.utils.dtype_names import KV_CODE_DTYPES

if TYPE_CHECKING:  # torch stays out of the processes that only pass layouts around (API server, engine)
    import torch

    from pdserve.config.model import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the full-width cache dtypes (--kv-cache-dtype)
SCALE_BYTES = 2  # a bf16 scale: fp32's range, and half of fp32's bytes where a head_dim of 64 needs them


class KVLayout(msgspec.Struct, frozen=True):
    num_blocks: int
    num_layers: int  # layer slots of a block: the model's layers, or with layer groups the largest group's
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    layer_groups: LayerGroups | None = None  # groups with block tables of their own (config/layer_groups.py)

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype | str,
                  groups: LayerGroups | None = None) -> KVLayout:
        """`groups`: the model's layer groups; one group (or None) keeps one block table for every layer."""
        grouped = groups if groups is not None and groups.num_groups > 1 else None
        return cls(num_blocks, grouped.slots if grouped else config.num_layers, block_size, config.num_kv_heads,
                   config.head_dim, str(dtype).removeprefix("torch."), grouped)

    @property
    def model_layers(self) -> int:
        """The model's layers (more than a block's slots where layers are grouped)."""
        return self.num_layers if self.layer_groups is None else sum(map(len, self.layer_groups.layers))

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a model layer: its block table and where in a block its K/V are."""
        return (0, layer) if self.layer_groups is None else self.layer_groups.place(layer)

    def places(self) -> list[tuple[int, int]]:
        """place() of every model layer, in order: looked up once by whoever reads layers by index."""
        return [self.place(layer) for layer in range(self.model_layers)]

    def with_blocks(self, num_blocks: int) -> KVLayout:
        return msgspec.structs.replace(self, num_blocks=num_blocks)

    @property
    def quantized(self) -> bool:
        """K/V stored as 8-bit codes with a scale per token and head."""
        return self.dtype in KV_CODE_DTYPES

    @property
    def shape(self) -> tuple[int, ...]:
        """The cache tensor's shape: elements of the dtype, or for an 8-bit cache each layer of a block in bytes."""
        if self.quantized:
            return (self.num_blocks, self.num_layers, self.layer_block_bytes)
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def code_shape(self) -> tuple[int, ...]:
        """Per block and layer, the K/V elements: `[2, block_size, kv_heads, head_dim]`."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def code_bytes(self) -> int:
        """The bytes of one layer of one block's K/V elements (an 8-bit cache's scales follow them)."""
        per_element = 1 if self.quantized else DTYPE_BYTES[self.dtype]
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * per_element

    @property
    def torch_dtype(self) -> Any:  # torch.dtype; torch is imported only by the processes that hold a cache
        """The cache tensor's dtype (bytes for an 8-bit cache)."""
        import torch

        return torch.uint8 if self.quantized else getattr(torch, self.dtype)

    @property
    def code_dtype(self) -> Any:
        """The dtype of one K/V element as stored: the cache dtype, or an 8-bit cache's codes."""
        import torch

        return getattr(torch, KV_CODE_DTYPES.get(self.dtype, self.dtype))

    def rank_share(self, ranks: int) -> KVLayout:
        """The layout of one tensor-parallel rank's part: its kv_heads / ranks heads of every block."""
        if self.num_kv_heads % ranks:
            raise ValueError(f"--tensor-parallel-size {ranks} does not divide the model's {self.num_kv_heads} KV heads")
        return msgspec.structs.replace(self, num_kv_heads=self.num_kv_heads // ranks)

    def same_geometry(self, other: KVLayout) -> bool:
        """Everything but the block count must agree for P's blocks to be D's blocks."""
        return self.with_blocks(0) == other.with_blocks(0)

    def compatibility_key(self, model: str) -> str:
        """What a P and a D must share to be paired: the model and every layout field but the block count."""
        groups = "" if self.layer_groups is None else f"|groups={self.layer_groups.layers}"
        return (f"{model}|block={self.block_size}|dtype={self.dtype}|layers={self.num_layers}"
                f"|kv_heads={self.num_kv_heads}|head_dim={self.head_dim}{groups}")

    @property
    def layer_block_bytes(self) -> int:
        scales = 2 * self.block_size * self.num_kv_heads * SCALE_BYTES if self.quantized else 0
        return self.code_bytes + scales

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


def layer_ranges(layout: KVLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int], slot: int) -> list[ByteRange]:
    """One layer slot of each block pair (a model layer's slot: `layout.place`; regions of different blocks are
    never adjacent)."""
    lb, bb = layout.layer_block_bytes, layout.block_bytes
    return [(s * bb + slot * lb, d * bb + slot * lb, lb) for s, d in zip(src_blocks, dst_blocks, strict=True)]


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


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count): pairs adjacent on both sides merged, so a
    copy between two caches of this layout is one slice copy per run."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
