"""The paged KV cache: one tensor per instance holding every layer's K and V in fixed-size blocks,
laid out as its KVLayout says (kv/layout.py): on the device, or in a named shared-memory segment that
the cache service attaches too. An 8-bit cache is a byte tensor seen through two views, its codes and its
scales (`QuantizedKV`).
"""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import NamedTuple

import torch

from pdserve.kv.layout import KVLayout
from pdserve.utils.shm_segment import attach_segment, create_segment, release_segment


class QuantizedKV(NamedTuple):
    """One layer of an 8-bit cache: codes `[blocks, 2 (K, V), block_size, kv_heads, head_dim]` (int8 or float8)
    and their bf16 scales `[blocks, 2, block_size, kv_heads]`; an element is code * scale."""
    codes: torch.Tensor
    scales: torch.Tensor


class KVCache:
    """Wraps the cache tensor (however it was allocated) with per-layer K/V views.

    `parts` are the tensors a block copy moves, each indexed [block, layer, ...]: the cache tensor itself, or
    an 8-bit cache's codes and scales (a tensor-parallel rank's view of its heads is strided in both)."""

    def __init__(self, layout: KVLayout, tensor: torch.Tensor,
                 shm: shared_memory.SharedMemory | None = None, owner: bool = False,
                 parts: tuple[torch.Tensor, ...] | None = None) -> None:
        if parts is None:
            if tuple(tensor.shape) != layout.shape or tensor.dtype != layout.torch_dtype:
                raise ValueError(f"KV cache tensor {tuple(tensor.shape)} {tensor.dtype} does not match {layout}")
            parts = _quantized_parts(layout, tensor) if layout.quantized else (tensor,)
        self.layout = layout
        self.tensor = tensor  # the whole allocation (for a rank's view too)
        self.parts = parts
        self.shm = shm
        self._owns_shm = owner
        # Per layer slot (a layer, or with layer groups one member of each group) a [num_blocks, 2 (K, V), block_size,
        # kv_heads, head_dim] strided view, or its codes and scales.
        self.layers: list[torch.Tensor | QuantizedKV] = (
            [QuantizedKV(parts[0][:, layer], parts[1][:, layer]) for layer in range(layout.num_layers)]
            if layout.quantized else [parts[0][:, layer] for layer in range(layout.num_layers)])
        # Per model layer: its slot's view and the layer group whose block tables it reads (config/layer_groups.py).
        self.by_layer = [(self.layers[slot], group) for group, slot in layout.places()]

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
        # dim 4 is the KV head in every part: [blocks, layers, 2, block_size, kv_heads, ...]
        return KVCache(share, self.tensor, parts=tuple(part[:, :, :, :, heads] for part in self.parts))

    def close(self) -> None:
        """Drop this process's mapping; the creating process also removes the segment."""
        self.layers = []
        self.tensor = None  # type: ignore[assignment]
        self.parts = ()
        if self.shm is not None:
            release_segment(self.shm, self._owns_shm)
            self.shm = None


def _tensor_over(shm: shared_memory.SharedMemory, layout: KVLayout) -> torch.Tensor:
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=layout.nbytes)
    return flat.view(layout.torch_dtype).view(layout.shape)


def _quantized_parts(layout: KVLayout, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit cache's bytes `[blocks, layers, layer_block_bytes]` as codes `[blocks, layers, 2, block_size,
    kv_heads, head_dim]` and bf16 scales `[blocks, layers, 2, block_size, kv_heads]`: views of the same memory."""
    lead = (layout.num_blocks, layout.num_layers)
    codes = tensor[:, :, :layout.code_bytes].view(layout.code_dtype).view(*lead, *layout.code_shape)
    scales = tensor[:, :, layout.code_bytes:].view(torch.bfloat16).view(*lead, *layout.code_shape[:-1])
    return codes, scales
