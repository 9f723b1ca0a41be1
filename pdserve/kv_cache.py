"""The paged KV cache: one tensor per instance holding every layer's K and V in fixed-size blocks.

Layout `[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`, block-major:
"layer L of block B" (its K and V) is one contiguous region, and so is a whole block across
layers. The P->D transfer sends exactly those regions, and runs of adjacent blocks coalesce.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from pdserve.kv_segment import attach_segment, create_segment, release_segment
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

    def __init__(self, spec: KVCacheSpec, tensor: torch.Tensor,
                 shm: shared_memory.SharedMemory | None = None, owner: bool = False) -> None:
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"KV cache tensor {tuple(tensor.shape)} {tensor.dtype} does not match {spec}")
        self.spec = spec
        self.tensor = tensor
        self.shm = shm
        self._owns_shm = owner
        # Per layer a [num_blocks, 2 (K, V), block_size, kv_heads, head_dim] strided view.
        self.layers = [tensor[:, layer] for layer in range(spec.num_layers)]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, device: torch.device | str) -> KVCache:
        return cls(spec, torch.zeros(spec.shape, dtype=spec.dtype, device=device))

    @property
    def shm_name(self) -> str | None:
        return self.shm.name if self.shm is not None else None

    @classmethod
    def create_shared(cls, spec: KVCacheSpec) -> KVCache:
        """A CPU cache in a named shared-memory segment that other processes can attach to.

        Pages are not touched here: the kernel zero-fills them on first use, so a large cache costs
        memory only as far as the load reaches.
        """
        shm = create_segment(spec.num_blocks * spec.bytes_per_block)
        return cls(spec, _tensor_over(shm, spec), shm, owner=True)

    @classmethod
    def attach_shared(cls, spec: KVCacheSpec, name: str) -> KVCache:
        shm = attach_segment(name, spec.num_blocks * spec.bytes_per_block)
        return cls(spec, _tensor_over(shm, spec), shm, owner=False)

    def close(self) -> None:
        """Drop this process's mapping; the creating process also removes the segment."""
        self.layers = []
        self.tensor = None  # type: ignore[assignment]
        if self.shm is not None:
            release_segment(self.shm, self._owns_shm)
            self.shm = None


def _tensor_over(shm: shared_memory.SharedMemory, spec: KVCacheSpec) -> torch.Tensor:
    nbytes = spec.num_blocks * spec.bytes_per_block
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
    return flat.view(spec.dtype).view(spec.shape)
