"""The paged KV cache: one tensor per instance holding every layer's K and V in fixed-size blocks.

Layout `[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`, block-major:
"layer L of block B" (its K and V) is one contiguous region, and so is a whole block across
layers. The P->D transfer sends exactly those regions, and runs of adjacent blocks coalesce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model_config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(num_blocks, config.num_layers, block_size, config.num_kv_heads, config.head_dim, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_layer_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_layer_block


class KVCache:
    """Wraps the cache tensor (however it was allocated) with per-layer K/V views."""

    def __init__(self, spec: KVCacheSpec, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"KV cache tensor {tuple(tensor.shape)} {tensor.dtype} does not match {spec}")
        self.spec = spec
        self.tensor = tensor
        # Per layer a [num_blocks, 2 (K, V), block_size, kv_heads, head_dim] strided view.
        self.layers = [tensor[:, layer] for layer in range(spec.num_layers)]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, device: torch.device | str) -> KVCache:
        return cls(spec, torch.zeros(spec.shape, dtype=spec.dtype, device=device))
