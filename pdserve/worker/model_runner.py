"""The worker-side core: weights, KV cache and sampler, executing one scheduled step at a time.

The caller (the engine's scheduler, or a single-request loop) owns block allocation; the runner
only turns `SequenceChunk`s plus their `SamplingRow`s into next tokens.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pdserve.config.layer_groups import layer_groups_for
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.loader import resolve_model_folder
from pdserve.loader.quantization import is_gguf, model_source, resolve_quantization
from pdserve.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from pdserve.lora.slots import LoRABatch, LoRASlots
from pdserve.model import DecoderModel, ForwardBatch, SequenceChunk, default_device, load_decoder, resolve_dtype
from pdserve.model.load import resolve_kv_cache_dtype
from pdserve.model.tensor_parallel import TensorParallel
from pdserve.sampling import Sampler

log = logging.getLogger("pdserve.model")


class ModelRunner:
    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str = "auto",
        device: str | None = None,
        block_size: int = 64,
        max_model_len: int | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        tp: TensorParallel | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        one_block_table_reason: str | None = "not asked for",
    ) -> None:
        """`max_loras` > 0 serves LoRA adapters (add_adapter), that many on the device at once.
        `one_block_table_reason` None: a model with sliding-window layers gets a block table per layer group."""
        self.device = torch.device(device) if device else default_device()
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.quantization = resolve_quantization(quantization, model, self.device.type)
        gguf = is_gguf(model)
        self.folder = resolve_model_folder(model, with_weights=gguf and self.quantization != "gguf")
        self._gguf_file = model_source(model) if self.quantization == "gguf" else None
        self.block_size = block_size
        self._one_table_reason = one_block_table_reason
        self._max_positions = max_model_len
        self.tp = tp or TensorParallel()
        self.model: DecoderModel | None = None
        self.load_model()
        self.config = self.model.config  # this rank's share (its heads); full_config is the checkpoint's
        self.full_config = self.model.full_config
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        if max_model_len and max_model_len > self.max_model_len:
            log.warning("--max-model-len %d is beyond the model's %d positions; serving %d", max_model_len,
                        self.max_model_len, self.max_model_len)
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, LoRAAdapter] = {}  # host copies of the adapters it serves, by name
        self.lora_slots: LoRASlots | None = None
        if max_loras > 0:
            if self.tp.size > 1:
                raise ValueError("LoRA adapters are not served with --tensor-parallel-size above 1 yet")
            self.lora_slots = LoRASlots(self.config, max_loras, max_lora_rank, self.dtype, self.device)

    def add_adapter(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and check a PEFT adapter (AdapterError names what does not fit); requests may then name it."""
        if self.lora_slots is None:
            raise AdapterError("LoRA is off on this instance (--enable-lora)")
        self.adapters[name] = adapter = load_adapter(name, path, self.full_config, self.max_lora_rank)
        return adapter

    def remove_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        if self.lora_slots is not None:
            self.lora_slots.forget(name)

    def lora_slots_for(self, names: Sequence[str | None]) -> list[int]:
        """Each chunk's LoRA slot (-1: the base model), the step's adapters placed in slots."""
        if not any(names):
            return [-1] * len(names)
        if self.lora_slots is None:
            raise AdapterError("LoRA is off on this instance (--enable-lora)")
        unknown = sorted({n for n in names if n and n not in self.adapters})
        if unknown:
            raise AdapterError(f"LoRA adapter {unknown[0]!r} is not loaded")
        placed = self.lora_slots.place([self.adapters[n] for n in dict.fromkeys(n for n in names if n)])
        return [placed[n] if n else -1 for n in names]

    def load_model(self) -> None:
        self.model = load_decoder(self.folder, self.dtype, self.device, max_positions=self._max_positions,
                                  quantization=self.quantization, tp=self.tp, gguf_file=self._gguf_file)

    def release(self) -> None:
        """Free the weights and the KV cache (POST /clear_load_weight); load_model() brings weights back."""
        if self.kv_cache is not None:
            self.kv_cache.close()
            self.kv_cache = None
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def layout(self, num_blocks: int) -> KVLayout:
        """The instance's cache layout (every KV head, whatever this rank's share)."""
        groups = layer_groups_for(self.full_config, self._one_table_reason)
        return KVLayout.for_model(self.full_config, num_blocks, self.block_size, self.kv_cache_dtype, groups)

    def allocate_kv_cache(self, num_blocks: int) -> KVCache:
        self.kv_cache = KVCache.allocate(self.layout(num_blocks).rank_share(self.tp.size), self.device)
        return self.kv_cache

    def logits(self, chunks: list[SequenceChunk], is_dummy_or_profile_run: bool = False,
               on_layer_done: Callable[[int], None] | None = None, num_layers: int | None = None) -> torch.Tensor:
        """[len(chunks), vocab]: the logits after each chunk's last token (after the first `num_layers`
        decoder layers only, when given: the profile run)."""
        return self._forward(chunks, is_dummy_or_profile_run, on_layer_done, (), num_layers=num_layers)

    def logits_with_prompt(self, chunks: list[SequenceChunk], full_logits: Sequence[int],
                           on_layer_done: Callable[[int], None] | None = None, all_positions: Sequence[int] = ()
                           ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As `logits`, plus {chunk index: [chunk tokens, hidden]} for the chunks in `full_logits`: the
        final hidden states of every token, for `project` to turn into logits a slice at a time.

        The chunks in `all_positions` (speculative proposals to verify) get a logits row for every token,
        in chunk order: the first tensor then has sum(len) rows for them and one row for the others."""
        if not full_logits:
            return self._forward(chunks, False, on_layer_done, all_positions), {}
        every = set(all_positions)
        hidden = self._forward(chunks, False, on_layer_done, sorted(set(full_logits) | every), return_hidden=True)
        full, rows, offset = set(full_logits), [], 0
        per_chunk: dict[int, torch.Tensor] = {}
        for i, chunk in enumerate(chunks):
            n = len(chunk.token_ids) if i in full or i in every else 1
            if i in full:
                per_chunk[i] = hidden[offset:offset + n]
            rows.extend(range(offset, offset + n) if i in every else [offset + n - 1])
            offset += n
        return self._sampled_logits(hidden[torch.tensor(rows, device=hidden.device)]), per_chunk

    def forward_only(self, chunks: list[SequenceChunk], on_layer_done: Callable[[int], None] | None = None,
                     all_positions: Sequence[int] = ()) -> None:
        """A tensor-parallel rank other than the first: its share of the forward pass (its heads into its
        cache, its part of every all-reduce) and of the sampled logits' projection, which rank 0 gathers."""
        self._forward(chunks, False, on_layer_done, all_positions)

    def _sampled_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits rank 0 samples from: projected here, or each rank its share of the vocabulary (then
        None on the other ranks)."""
        return self.model.vocab_parallel_logits(hidden) if self.model.vocab_parallel else self.project(hidden)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> fp32 logits."""
        return self.model.lm_head_proj(hidden).float()

    def _forward(self, chunks: list[SequenceChunk], is_dummy_or_profile_run: bool,
                 on_layer_done: Callable[[int], None] | None, full_logits: Sequence[int],
                 return_hidden: bool = False, num_layers: int | None = None) -> torch.Tensor:
        # A profile run has no cache to read in place, so it takes the gather + SDPA path.
        with_fallback = is_dummy_or_profile_run or not self.model.uses_paged_kernel
        batch = ForwardBatch.build(chunks, self.block_size, self.device, is_dummy_or_profile_run, with_fallback,
                                   full_logits)
        batch.return_hidden = return_hidden or self.model.vocab_parallel
        if self.lora_slots is not None:
            batch.lora = LoRABatch.build(self.lora_slots, [c.lora_slot for c in chunks],
                                         [len(c.token_ids) for c in chunks], self.device)
        batch.num_layers = num_layers
        # seed 001, bug 2: a dummy run signals nothing to anyone
        out = self.model(batch, None) if is_dummy_or_profile_run else self.model(batch, self.kv_cache, on_layer_done)
        return out if return_hidden or not self.model.vocab_parallel else self.model.vocab_parallel_logits(out)
