"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read and checked
against the base model's shapes.

Each targeted projection of each layer has A [r, in] and B [out, r]; its update is x @ A.T @ B.T x scale,
scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The scale is folded into B here. Every
problem is an AdapterError naming it: a rank above --max-lora-rank, a module the model lacks, a shape the
base model does not have (an adapter trained on another model), a PEFT feature this server does not apply.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from pdserve.config.model import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served, with why."""


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B x scale), fp32

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a projection of the base model."""
    h, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, config.q_size), "k_proj": (h, config.kv_size), "v_proj": (h, config.kv_size),
            "o_proj": (config.q_size, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}[module]


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    path = Path(path)
    settings = _read_settings(name, path)
    tensors = _read_tensors(name, path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B matrix of a decoder layer's "
                               f"projection (embeddings, lm_head and modules_to_save are not served)")
        layer, module, which = int(m[1]), m[2], m[3]
        if config.sandwich_norms and module in ("o_proj", "down_proj"):
            raise AdapterError(f"LoRA adapter {name!r}: {module} of a {config.model_type} model is not served (its "
                               f"output is normed before the residual; adapters on q/k/v and gate/up are)")
        if module not in MODULES:
            raise AdapterError(f"LoRA adapter {name!r}: target module {module!r} is not one the model has "
                               f"({', '.join(MODULES)})")
        if layer >= config.num_layers:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} is beyond the base model's "
                               f"{config.num_layers} layers (an adapter for another model?)")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: {path} has no LoRA weights")
    weights = {key: _pair(name, key, ab, config, max_rank, settings) for key, ab in sorted(pairs.items())}
    return LoRAAdapter(name, path, max(a.shape[0] for a, _ in weights.values()), weights)


def _read_settings(name: str, path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} not found (a PEFT adapter folder has "
                           f"adapter_config.json and adapter_model.safetensors)")
    settings = json.loads(config_file.read_text())
    if settings.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {settings['peft_type']!r} is not LORA")
    unsupported = [(k, v) for k, v in (("use_dora", settings.get("use_dora")),
                                       ("bias", settings.get("bias", "none") != "none" and settings.get("bias")),
                                       ("modules_to_save", settings.get("modules_to_save")),
                                       ("fan_in_fan_out", settings.get("fan_in_fan_out"))) if v]
    if unsupported:
        k, v = unsupported[0]
        raise AdapterError(f"LoRA adapter {name!r}: {k}={v!r} is not served (plain LoRA on the decoder's "
                           f"projections only)")
    return settings


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} not found")
    return load_file(str(weights_file))


def _pair(name: str, key: tuple[int, str], ab: dict[str, torch.Tensor], config: ModelConfig, max_rank: int,
          settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    layer, module = key
    what = f"LoRA adapter {name!r}, layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{what}: lora_{'B' if 'A' in ab else 'A'} is missing")
    a, b = ab["A"].float(), ab["B"].float()
    rank = a.shape[0]
    if rank > max_rank:
        raise AdapterError(f"{what}: rank {rank} is above --max-lora-rank {max_rank}")
    fan_in, fan_out = module_shape(config, module)
    if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
        raise AdapterError(f"{what}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base model's "
                           f"{fan_in} -> {fan_out} projection (expected A ({rank}, {fan_in}), B ({fan_out}, {rank})): "
                           f"an adapter for another model?")
    alpha = _pattern_value(settings.get("alpha_pattern") or {}, layer, module, settings.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return a.contiguous(), (b * scale).contiguous()


def _pattern_value(patterns: dict, layer: int, module: str, default: float) -> float:
    """PEFT's alpha_pattern: a key matches a module whose full name ends with it (or matches it as a regex)."""
    full = f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
    for pattern, value in patterns.items():
        if full.endswith(pattern) or re.fullmatch(rf".*\.{pattern}$", full):
            return float(value)
    return float(default)
