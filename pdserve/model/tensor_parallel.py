"""Tensor parallelism inside the decoder (Megatron's split): which slice of each weight a rank holds, and the
all-reduce that joins the ranks' partial sums.

Attention heads and KV heads are split into contiguous ranges, rank i taking heads [i*h/n, (i+1)*h/n): q/k/v
are column-parallel (each rank computes its heads' projections), o is row-parallel (each rank multiplies its
heads' part of the attention output; the all-reduce sums them). The MLP likewise: gate/up by intermediate
columns, down by rows. Embedding, norms and LM head are replicated (the embedded model's vocabulary matrix is
its largest tensor and also its tied LM head). The logits the sampler needs are computed vocabulary-parallel (each
rank its 1/N of the vocabulary, gathered on rank 0, which samples); rank 0 keeps the whole LM head for prompt
scoring, which it does alone. A row-parallel bias is
added by rank 0 only, so the sum holds it once. A rank's KV cache holds its KV heads only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config.model import ModelConfig
from pdserve.loader.gguf_blocks import QuantizedMatrix


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group of the instance's ranks (None: the default group)
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # an in-place sum over ranks (CPU: shared memory)
    gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None  # ranks' columns side by side on rank 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    def check(self, config: ModelConfig) -> None:
        """A model whose heads (or MLP width) do not divide by the rank count cannot be split: say which."""
        if refusal := config.tensor_parallel_refusal(self.size):
            raise ValueError(refusal)

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The shape of this rank's part of the model (its heads, its MLP columns)."""
        self.check(config)
        return dataclasses.replace(config, num_heads=config.num_heads // self.size,
                                   num_kv_heads=config.num_kv_heads // self.size,
                                   intermediate_size=config.intermediate_size // self.size)

    def part(self, total: int) -> slice:
        """This rank's contiguous share of `total` rows or columns."""
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a no-op on one rank)."""
        if self.size == 1:
            return x
        if self.reduce is not None:
            return self.reduce(x)
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's [rows, cols] side by side in rank order, [rows, size * cols]; other ranks: None."""
        if self.size == 1:
            return x
        if self.gather is not None:
            return self.gather(x)
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1) if parts is not None else None

    def shard(self, kind: str, tensor: Any, full: ModelConfig) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor of a projection (`q_proj`, `down_proj`, ...) or a bias.
        `tensor` may be a safetensors slice (the file's tensor not yet read): then only this rank's part is read; or a
        GGUF block-format matrix, split at whole blocks."""
        if self.size == 1:
            return _read(tensor)
        head_dim = full.head_dim
        column = {"q_proj": full.num_heads * head_dim, "k_proj": full.num_kv_heads * head_dim,
                  "v_proj": full.num_kv_heads * head_dim, "gate_proj": full.intermediate_size,
                  "up_proj": full.intermediate_size}
        projection, is_bias = kind.removesuffix(".bias"), kind.endswith(".bias")
        if projection in column:  # output rows (and their bias) split
            return tensor[self.part(column[projection])]
        if projection in ("o_proj", "down_proj"):  # input columns split; the bias is added once
            if is_bias:
                return _read(tensor) if self.rank == 0 else torch.zeros_like(_read(tensor))
            return tensor[:, self.part(_shape(tensor)[1])]
        return _read(tensor)  # norms, embedding, LM head: replicated


def _read(tensor: Any) -> torch.Tensor:
    """A tensor (or block-format matrix), or the whole of a safetensors slice."""
    return tensor if isinstance(tensor, torch.Tensor | QuantizedMatrix) else tensor[:]


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor | QuantizedMatrix) else tuple(tensor.get_shape())
