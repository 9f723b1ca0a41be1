"""The paged KV cache: one tensor per instance holding every layer's K and V in fixed-size blocks,
laid out as its KVLayout says (kv/layout.py): on the device, or in a named shared-memory segment that
the cache service attaches too.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import torch

from pdserve.kv.layout import KVLayout
from pdserve.utils.shm_segment import attach_segment, create_segment, release_segment


class KVCache:
    """Wraps the cache tensor (however it was allocated) with per-layer K/V views."""

    def __init__(self, layout: KVLayout, tensor: torch.Tensor,
                 shm: shared_memory.SharedMemory | None = None, owner: bool = False) -> None:
        if tuple(tensor.shape) != layout.shape or tensor.dtype != layout.torch_dtype:
            raise ValueError(f"KV cache tensor {tuple(tensor.shape)} {tensor.dtype} does not match {layout}")
        self.layout = layout
        self.tensor = tensor
        self.shm = shm
        self._owns_shm = owner
        # Per layer a [num_blocks, 2 (K, V), block_size, kv_heads, head_dim] strided view.
        self.layers = [tensor[:, layer] for layer in range(layout.num_layers)]

    @classmethod
    def allocate(cls, layout: KVLayout, device: torch.device | str) -> KVCache:
        return cls(layout, torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device))

    @property
    def shm_name(self) -> str | None:
        return self.shm.name if self.shm is not None else None

    @classmethod
    def create_shared(cls, layout: KVLayout) -> KVCache:
        """A CPU cache in a named shared-memory segment that other processes can attach to.

        Pages are not touched here: the kernel zero-fills them on first use, so a large cache costs
        memory only as far as the load reaches.
        """
        shm = create_segment(layout.nbytes)
        return cls(layout, _tensor_over(shm, layout), shm, owner=True)

    @classmethod
    def attach_shared(cls, layout: KVLayout, name: str) -> KVCache:
        shm = attach_segment(name, layout.nbytes)
        return cls(layout, _tensor_over(shm, layout), shm, owner=False)

    def rank_view(self, rank: int, ranks: int) -> KVCache:
        """Tensor-parallel rank `rank`'s heads of this cache, in place: a strided view of the same memory
        (the caller keeps this cache open while it uses the view)."""
        if ranks == 1:
            return self
        share = self.layout.rank_share(ranks)
        heads = slice(rank * share.num_kv_heads, (rank + 1) * share.num_kv_heads)
        return KVCache(share, self.tensor[:, :, :, :, heads])

    def close(self) -> None:
        """Drop this process's mapping; the creating process also removes the segment."""
        self.layers = []
        self.tensor = None  # type: ignore[assignment]
        if self.shm is not None:
            release_segment(self.shm, self._owns_shm)
            self.shm = None


def _tensor_over(shm: shared_memory.SharedMemory, layout: KVLayout) -> torch.Tensor:
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=layout.nbytes)
    return flat.view(layout.torch_dtype).view(layout.shape)
