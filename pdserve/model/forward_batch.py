"""One forward step's inputs: a flat token batch mixing prefill chunks and decode tokens.

Everything attention needs per step is built here once, so the 30-odd layers reuse it and no
per-layer code does Python work per token. The metadata is vLLM's varlen form, built with array
operations (no Python loop per token):

- `slots`: where each new token's K/V goes (block id x block_size + offset);
- `block_tables` [num_seqs, max_blocks] int32, `seq_lens` (context length after this step) and
  `query_start_loc` [num_seqs + 1]: what the paged attention kernel reads.

When the compiled kernel is not in use (no C++ build, or CUDA), `fallback` adds the per-chunk
masks and gather indices of the gather + SDPA path.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pdserve.lora.slots import LoRABatch


@dataclass
class SequenceChunk:
    """The tokens of one sequence computed in this step."""

    token_ids: list[int]
    num_computed: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # block ids holding this sequence, in order (layer group 0's)
    lora_slot: int = -1  # the LoRA slot (lora/slots.py) its tokens compute with; -1: the base model
    # With layer groups (config/layer_groups.py): the tables of groups 1.. . A sliding-window group's table holds 0
    # where its blocks fell out of the window (never read: the attention sees only the window's keys).
    group_tables: list[list[int]] = field(default_factory=list)

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
class FallbackAttention:
    """What the gather + SDPA path needs on top of the varlen metadata."""

    slot_blocks: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    prefills: list[PrefillAttention]
    decode: DecodeAttention | None
    _windowed: dict[int, FallbackAttention] = field(default_factory=dict, repr=False)

    def windowed(self, window: int, device: torch.device) -> FallbackAttention:
        """The same step for a sliding-window layer: a query sees only the last `window` keys, itself included
        (built once per step and window)."""
        if window not in self._windowed:
            d = self.decode
            if d is not None:
                lens = d.mask.sum(dim=-1, keepdim=True)  # [B, 1, 1, 1]: each sequence's context
                key_pos = torch.arange(d.mask.shape[-1], device=d.mask.device)
                d = replace(d, mask=d.mask & (key_pos > lens - 1 - window))
            prefills = [_windowed_prefill(p, window, device) for p in self.prefills]
            self._windowed[window] = replace(self, prefills=prefills, decode=d, _windowed={})
        return self._windowed[window]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [num_seqs] last token of each chunk (every token of a full_logits chunk)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    block_size: int
    fallback: FallbackAttention | None = None  # set when the compiled kernel is not used
    lora: LoRABatch | None = None  # the step's tokens grouped by LoRA adapter, when any uses one
    # A profile or dummy run: touches no other component (no KV signals, no messages).
    is_dummy_or_profile_run: bool = False
    # The model returns the final-normed hidden states at logits_indices, not logits (prompt logprobs:
    # the caller projects them in slices, so a long prompt never holds [tokens, vocab] at once).
    return_hidden: bool = False
    # Run only the first n decoder layers (the profile run: each layer frees its temporaries before the next
    # starts, so the peak of a whole forward is reached within its first two layers).
    num_layers: int | None = None
    other_groups: list[ForwardBatch] = field(default_factory=list)  # layer groups 1..: their tables and slots

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def group(self, group: int) -> ForwardBatch:
        """This step as layer group `group`'s attention sees it (its block tables and slots)."""
        if group > len(self.other_groups):
            raise ValueError(f"the step's chunks have no block table for layer group {group}")
        return self if group == 0 else self.other_groups[group - 1]

    @classmethod
    def build(
        cls,
        chunks: list[SequenceChunk],
        block_size: int,
        device: torch.device | str = "cpu",
        is_dummy_or_profile_run: bool = False,
        with_fallback: bool = True,
        full_logits: Sequence[int] = (),
    ) -> ForwardBatch:
        """`full_logits`: chunks whose every token gets logits (prompt logprobs), not just the last."""
        if not chunks:
            raise ValueError("a forward batch needs at least one sequence")
        q_lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
        done = np.fromiter((c.num_computed for c in chunks), dtype=np.int64, count=len(chunks))
        if (q_lens == 0).any():
            raise ValueError("a sequence chunk needs at least one token")
        seq_lens = done + q_lens
        starts = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        seq_of_token = np.repeat(np.arange(len(chunks)), q_lens)
        positions = np.arange(starts[-1]) - np.repeat(starts[:-1] - done, q_lens)
        tables, slots = _tables_and_slots([c.block_table for c in chunks], seq_lens, seq_of_token, positions,
                                          block_size)
        input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                                count=int(starts[-1]))

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        batch = cls(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slots=tensor(slots),
            logits_indices=tensor(_logits_indices(starts, set(full_logits))),
            block_tables=tensor(tables),
            seq_lens=tensor(seq_lens.astype(np.int32)),
            query_start_loc=tensor(starts.astype(np.int32)),
            block_size=block_size,
            is_dummy_or_profile_run=is_dummy_or_profile_run,
        )
        if with_fallback:
            batch.fallback = _fallback(chunks, starts, slots, block_size, device)
        for g in range(len(chunks[0].group_tables)):
            group_chunks = [replace(c, block_table=c.group_tables[g], group_tables=[]) for c in chunks]
            tables, slots = _tables_and_slots([c.block_table for c in group_chunks], seq_lens, seq_of_token,
                                              positions, block_size)
            view = replace(batch, slots=tensor(slots), block_tables=tensor(tables), other_groups=[])
            view.fallback = _fallback(group_chunks, starts, slots, block_size, device) if with_fallback else None
            batch.other_groups.append(view)
        return batch


def _tables_and_slots(block_tables: list[list[int]], seq_lens: np.ndarray, seq_of_token: np.ndarray,
                      positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[num_seqs, max_blocks] block tables padded with 0, and each new token's slot."""
    max_blocks = int(-(-seq_lens.max() // block_size))
    tables = np.zeros((len(block_tables), max_blocks), dtype=np.int32)
    for i, table in enumerate(block_tables):
        needed = -(-int(seq_lens[i]) // block_size)
        if needed > len(table):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_lens[i]} tokens")
        tables[i, :needed] = table[:needed]
    slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return tables, slots


def _windowed_prefill(p: PrefillAttention, window: int, device: torch.device) -> PrefillAttention:
    """Query i (at position num_computed + i) sees keys j with i's position - window < j <= its position."""
    if p.mask is None and p.length <= window:
        return p  # causal already keeps every key within the window
    key_pos = torch.arange(p.num_computed + p.length, device=device)
    query_pos = torch.arange(p.num_computed, p.num_computed + p.length, device=device).unsqueeze(1)
    causal = key_pos.unsqueeze(0) <= query_pos if p.mask is None else p.mask
    return replace(p, mask=causal & (key_pos.unsqueeze(0) > query_pos - window))


def _logits_indices(starts: np.ndarray, full: set[int]) -> np.ndarray:
    if not full:
        return starts[1:] - 1
    return np.concatenate([np.arange(starts[i], starts[i + 1]) if i in full else starts[i + 1:i + 2] - 1
                           for i in range(len(starts) - 1)])


def _fallback(chunks: list[SequenceChunk], starts: np.ndarray, slots: np.ndarray, block_size: int,
              device: torch.device | str) -> FallbackAttention:
    prefills: list[PrefillAttention] = []
    decodes: list[tuple[int, SequenceChunk]] = []
    for start, chunk in zip(starts.tolist(), chunks, strict=False):
        if len(chunk.token_ids) == 1 and chunk.num_computed > 0:
            decodes.append((start, chunk))
        else:
            prefills.append(_prefill_attention(start, chunk, block_size, device))
    slot_tensor = torch.from_numpy(slots).to(device)
    return FallbackAttention(
        slot_blocks=slot_tensor // block_size,
        slot_offsets=slot_tensor % block_size,
        prefills=prefills,
        decode=_decode_attention(decodes, block_size, device, whole_batch=not prefills) if decodes else None,
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
