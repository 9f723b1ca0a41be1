"""Up to --max-loras adapters on the device at once, stacked per layer and fused projection, and their
application to a step whose sequences use different adapters (or none).

The decoder fuses q|k|v and gate|up into one matmul each; an adapter's parts of a fused projection are
stacked the same way: A [parts x R, in] (each part's A in its rows, zero-padded to R) and B block-diagonal
(kept transposed, [parts x R, out]), so one fused projection's update is two small matmuls. A step's
update is computed for all its tokens at once (LoRABatch: by group or by mask), never a forward pass per
adapter (the segmented / gathered LoRA of punica and SGLang, with torch ops). Slots are reused least
recently used first; an adapter not in a slot is copied in from its host copy (LoRAAdapter) when a step
needs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.config.model import ModelConfig
from pdserve.lora.adapter import LoRAAdapter, module_shape

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.max_rank = config, max_rank
        kw = {"dtype": dtype, "device": device}
        self.a: dict[str, list[torch.Tensor]] = {}  # [slots, width, in]
        self.bt: dict[str, list[torch.Tensor]] = {}  # [slots x width, out]: B transposed, slots stacked in rows
        self.width = {proj: len(parts) * max_rank for proj, parts in FUSED.items()}
        for proj, parts in FUSED.items():
            fan_in = module_shape(config, parts[0])[0]
            fan_out = sum(module_shape(config, p)[1] for p in parts)
            w = self.width[proj]
            self.a[proj] = [torch.zeros(max_loras, w, fan_in, **kw) for _ in range(config.num_layers)]
            self.bt[proj] = [torch.zeros(max_loras * w, fan_out, **kw) for _ in range(config.num_layers)]
        self.names: list[str | None] = [None] * max_loras
        self.targets: list[set[str]] = [set() for _ in range(max_loras)]  # the fused projections each one adapts
        self._used = [0] * max_loras  # the step that last used each slot
        self._step = 0

    def place(self, adapters: list[LoRAAdapter]) -> dict[str, int]:
        """A slot for each adapter of a step (at most max_loras of them), copying in the ones not in a slot."""
        self._step += 1
        if len(adapters) > len(self.names):
            raise RuntimeError(f"a step used {len(adapters)} LoRA adapters; at most {len(self.names)} fit "
                               f"(--max-loras)")
        wanted = {a.name for a in adapters}
        out = {}
        for adapter in adapters:
            if adapter.name in self.names:
                slot = self.names.index(adapter.name)
            else:
                slot = min((i for i, n in enumerate(self.names) if n not in wanted), key=lambda i: self._used[i])
                self._write(slot, adapter)
            self._used[slot] = self._step
            out[adapter.name] = slot
        return out

    def forget(self, name: str) -> None:
        """An unloaded adapter's slot is free (and never matched again)."""
        if name in self.names:
            slot = self.names.index(name)
            self.names[slot], self._used[slot] = None, 0

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.max_rank
        self.targets[slot] = {proj for proj, parts in FUSED.items() if adapter.modules & set(parts)}
        for proj, parts in FUSED.items():
            w = self.width[proj]
            for layer in range(self.config.num_layers):
                a, bt = self.a[proj][layer][slot], self.bt[proj][layer][slot * w:(slot + 1) * w]
                a.zero_()
                bt.zero_()
                col = 0
                for i, part in enumerate(parts):
                    fan_out = module_shape(self.config, part)[1]
                    if (pair := adapter.weights.get((layer, part))) is not None:
                        pa, pb = pair
                        a[i * r:i * r + pa.shape[0]].copy_(pa)
                        bt[i * r:i * r + pb.shape[1], col:col + fan_out].copy_(pb.t())
                    col += fan_out
        self.names[slot] = adapter.name


class LoRABatch:
    """A step's LoRA work. Two ways, by what is cheaper on a CPU, where a small matmul costs tens of
    microseconds whatever its size:
    - by group: a slot whose tokens are one run (a long prompt chunk, or a step of one adapter's decodes) adds
      x @ A.T @ B.T on its rows only;
    - by mask, for many short groups (decodes of several adapters interleaved): x @ [A of every slot].T once,
      each token's columns of other slots zeroed, then @ [B of every slot] once: three ops per projection
      whatever the number of adapters (measured at batch 16, bf16: 4 adapters cost what one does).
    A projection no adapter of the step touches is skipped."""

    MASK_ROWS = 256  # up to this many tokens a step takes the mask path

    def __init__(self, slots: LoRASlots, groups: list[tuple[int, slice]] | None,
                 token_slots: torch.Tensor | None, num_slots: int, projections: set[str]) -> None:
        self.slots, self.groups, self.projections = slots, groups, projections
        self.num_slots = num_slots  # slots 0 .. num_slots - 1 cover the step's adapters
        self._masks: dict[int, torch.Tensor] = {}
        self._token_slots = token_slots

    @classmethod
    def build(cls, slots: LoRASlots, chunk_slots: list[int], chunk_lengths: list[int], device: torch.device
              ) -> LoRABatch | None:
        """None when no sequence of the step uses an adapter (slot -1: the base model)."""
        used = {s for s in chunk_slots if s >= 0}
        if not used:
            return None
        projections = set().union(*(slots.targets[s] for s in used))
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(chunk_slots, chunk_lengths, strict=True):
            if slot >= 0:
                spans = runs.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        one_run_each = all(len(spans) == 1 for spans in runs.values())
        if one_run_each and (start > cls.MASK_ROWS or len(runs) == 1):
            return cls(slots, [(s, slice(*spans[0])) for s, spans in runs.items()], None, 0, projections)
        token_slots = torch.repeat_interleave(torch.tensor(chunk_slots), torch.tensor(chunk_lengths)).to(device)
        return cls(slots, None, token_slots, max(used) + 1, projections)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """out += x @ A.T @ B.T, each token with its slot's adapter (in place)."""
        if proj not in self.projections:
            return
        w = self.slots.width[proj]
        a_all, bt_all = self.slots.a[proj][layer], self.slots.bt[proj][layer]
        if self.groups is not None:
            for slot, rows in self.groups:
                out[rows].addmm_(F.linear(x[rows], a_all[slot]), bt_all[slot * w:(slot + 1) * w])
            return
        k = self.num_slots
        h = F.linear(x, a_all[:k].view(k * w, -1)).mul_(self._mask(w, x.dtype))
        out.addmm_(h, bt_all[:k * w])

    def _mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, slots x width]: 1 in the columns of the token's own slot."""
        if width not in self._masks:
            k = self.num_slots
            onehot = self._token_slots[:, None] == torch.arange(k, device=self._token_slots.device)[None, :]
            self._masks[width] = onehot.to(dtype).repeat_interleave(width, dim=1)
        return self._masks[width]
