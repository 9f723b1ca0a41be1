"""One forward step's inputs: a flat token batch mixing prefill chunks and decode tokens.

Everything that attention needs per step (slots to write, block tables, masks) is built here once,
so the 30-odd layers reuse it and the per-layer code has no Python work per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceChunk:
    """The tokens of one sequence computed in this step."""

    token_ids: list[int]
    num_computed: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # block ids holding this sequence, in order

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass
class PrefillAttention:
    """A chunk of more than one token: attends causally over its cached prefix plus itself."""

    start: int  # first token's index in the flat batch
    length: int
    num_computed: int
    block_ids: torch.Tensor | None  # blocks to gather the cached prefix from; None if no prefix
    mask: torch.Tensor | None  # [length, context_len] bool, None when `is_causal` suffices


@dataclass
class DecodeAttention:
    """Single-token sequences, attended as one padded batch over their gathered blocks."""

    token_index: torch.Tensor  # [B] positions in the flat batch
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0 (masked out)
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool
    is_whole_batch: bool = False  # every token of the step is a decode token, in order


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T] block each new token's K/V goes to
    slot_offsets: torch.Tensor  # [T] offset inside that block
    logits_indices: torch.Tensor  # [num_seqs] last token of each chunk
    prefills: list[PrefillAttention]
    decode: DecodeAttention | None
    # A profile or dummy run: touches no other component (no KV signals, no messages).
    is_dummy_or_profile_run: bool = False

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        chunks: list[SequenceChunk],
        block_size: int,
        device: torch.device | str = "cpu",
        is_dummy_or_profile_run: bool = False,
    ) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        logits_indices: list[int] = []
        prefills: list[PrefillAttention] = []
        decodes: list[tuple[int, SequenceChunk]] = []
        for chunk in chunks:
            start, n = len(input_ids), len(chunk.token_ids)
            if n == 0:
                raise ValueError("a sequence chunk needs at least one token")
            if chunk.context_len > len(chunk.block_table) * block_size:
                raise ValueError(f"block table of {len(chunk.block_table)} blocks cannot hold "
                                 f"{chunk.context_len} tokens")
            pos = range(chunk.num_computed, chunk.context_len)
            input_ids.extend(chunk.token_ids)
            positions.extend(pos)
            slot_blocks.extend(chunk.block_table[p // block_size] for p in pos)
            slot_offsets.extend(p % block_size for p in pos)
            logits_indices.append(start + n - 1)
            if n == 1 and chunk.num_computed > 0:
                decodes.append((start, chunk))
            else:
                prefills.append(_prefill_attention(start, chunk, block_size, device))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_blocks=tensor(slot_blocks),
            slot_offsets=tensor(slot_offsets),
            logits_indices=tensor(logits_indices),
            prefills=prefills,
            decode=_decode_attention(decodes, block_size, device, whole_batch=not prefills) if decodes else None,
            is_dummy_or_profile_run=is_dummy_or_profile_run,
        )


def _prefill_attention(start: int, chunk: SequenceChunk, block_size: int, device: torch.device | str
                       ) -> PrefillAttention:
    n, done = len(chunk.token_ids), chunk.num_computed
    if done == 0:
        return PrefillAttention(start, n, 0, None, None)
    num_blocks = -(-chunk.context_len // block_size)
    block_ids = torch.tensor(chunk.block_table[:num_blocks], dtype=torch.long, device=device)
    # Query i sits at position done + i and sees keys 0 .. done + i.
    key_pos = torch.arange(chunk.context_len, device=device)
    query_pos = torch.arange(done, done + n, device=device)
    mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    return PrefillAttention(start, n, done, block_ids, mask)


def _decode_attention(decodes: list[tuple[int, SequenceChunk]], block_size: int, device: torch.device | str,
                      whole_batch: bool) -> DecodeAttention:
    lens = [c.context_len for _, c in decodes]
    max_blocks = -(-max(lens) // block_size)
    tables = [c.block_table[:max_blocks] + [0] * (max_blocks - len(c.block_table[:max_blocks]))
              for _, c in decodes]
    key_pos = torch.arange(max_blocks * block_size, device=device)
    mask = key_pos.unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
    return DecodeAttention(
        token_index=torch.tensor([s for s, _ in decodes], dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        mask=mask[:, None, None, :],
        is_whole_batch=whole_batch,
    )
