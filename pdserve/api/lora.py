"""The adapters `pdserve serve --enable-lora` serves: a request names one in `model` (vLLM's way); the
answers name it too. /v1/models lists them under the base model (`parent`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.config.lora import RUNTIME_LOADING_ENV, LoRAModule


@dataclass
class LoRAServing:
    adapters: dict[str, LoRAModule] = field(default_factory=dict)
    runtime_loading: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter

    @classmethod
    def of(cls, modules: tuple[LoRAModule, ...], runtime_loading: bool) -> LoRAServing:
        env = os.environ.get(RUNTIME_LOADING_ENV, "").lower() in ("1", "true")
        return cls({m.name: m for m in modules}, runtime_loading or env)

    def model_cards(self, base: str) -> list[dict]:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve", "root": m.path,
                 "parent": m.base_model_name or base} for name, m in self.adapters.items()]
