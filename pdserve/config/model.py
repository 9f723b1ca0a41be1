"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`.

One dataclass covers llama, mistral, qwen2, qwen3 and ernie4_5: they differ only in a few
switches (biases, QK norm, RoPE style), so the decoder has no per-architecture classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "ernie4_5")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    interleaved: bool = False  # GPT-J style pairs (ERNIE 4.5) instead of rotate_half halves


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def tensor_parallel_refusal(self, ranks: int) -> str | None:
        """Why this model cannot be split over `ranks` tensor-parallel ranks (None: it can): naming the numbers."""
        for what, n in (("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                        ("MLP intermediate size", self.intermediate_size)):
            if n % ranks:
                return f"--tensor-parallel-size {ranks} does not divide the model's {n} {what}"
        return None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported architecture {model_type!r} (model_type in config.json); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            max_pos = int(cfg.get("max_position_embeddings", 2048))
            window = _sliding_window(cfg)
            if window is not None and window < max_pos:
                # Full attention equals sliding-window attention up to the window length.
                max_pos = window
            attention_bias = bool(cfg.get("attention_bias", False))
            use_bias = bool(cfg.get("use_bias", False))  # ERNIE 4.5: every linear layer
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=max_pos,
                rope=_rope_config(cfg, model_type),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=(model_type == "qwen2") or attention_bias or use_bias,
                o_bias=(attention_bias and model_type != "qwen2") or use_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)) or use_bias,
                qk_norm=model_type == "qwen3",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has an invalid value: {e}") from None


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _rope_config(cfg: dict[str, Any], model_type: str) -> RopeConfig:
    # transformers v5 writes `rope_parameters`; v4 writes `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"unsupported RoPE scaling {rope_type!r}; supported: default, linear, llama3")
    factor = float(params.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise ModelLoadError(f"invalid RoPE scaling factor {factor}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        interleaved=model_type == "ernie4_5",
    )
