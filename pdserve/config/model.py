"""The shape of a decoder, read from a Hugging Face `config.json`.

One dataclass covers llama, mistral, qwen2, qwen3, ernie4_5 and gemma3: they differ only in a few
switches (biases, QK norm, RoPE style; Gemma's scaled embeddings, zero-centred norms around each block, GeGLU
and sliding-window layers), so the decoder has no per-architecture classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "ernie4_5", "gemma3_text", "gemma3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # HF name -> ours


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
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # Gemma: norms scale by (1 + weight) (the checkpoint holds the offset-free weight), each block's output is
    # normed before it joins the residual, the embeddings are scaled by sqrt(hidden), and the attention scale is
    # query_pre_attn_scalar ** -0.5.
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Per layer, the keys a query sees: 0 for all before it, else only the last `window` (itself included).
    layer_windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None  # the sliding-window layers' RoPE, where it differs

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

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
        if model_type == "gemma3":  # the multimodal checkpoint: its text decoder
            cfg = {**cfg.get("text_config", {}), "model_type": "gemma3_text"}
        if model_type.startswith("gemma3"):
            return _gemma3(cfg)
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


def _gemma3(cfg: dict[str, Any]) -> ModelConfig:
    """Gemma 3's text decoder: local (sliding-window) and global layers in `layer_types`, each kind with its RoPE."""
    try:
        act = ACTIVATIONS.get(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
        if act != "gelu_tanh":
            raise ModelLoadError(f"unsupported Gemma 3 activation {cfg.get('hidden_activation')!r}")
        for softcap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(softcap):
                raise ModelLoadError(f"{softcap} is not supported (Gemma 3 checkpoints have none)")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or 256)
        layers = int(cfg["num_hidden_layers"])
        window = int(cfg.get("sliding_window") or 4096)
        kinds = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) == 0 else "sliding_attention"
            for i in range(layers)]
        if len(kinds) != layers or set(kinds) - {"full_attention", "sliding_attention"}:
            raise ModelLoadError(f"layer_types must name full_attention or sliding_attention for each of {layers}")
        params = cfg.get("rope_parameters") or {}
        full = params.get("full_attention") or {"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                                                **(cfg.get("rope_scaling") or {})}
        local = params.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
        eos = cfg.get("eos_token_id")
        return ModelConfig(
            model_type="gemma3_text",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            rope=_rope_config({"rope_parameters": full}, "gemma3_text"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            activation=act,
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=hidden ** 0.5,
            attention_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
            local_rope=_rope_config({"rope_parameters": local}, "gemma3_text"),
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
