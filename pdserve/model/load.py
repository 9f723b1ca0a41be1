"""Build a DecoderModel from a model folder, on any device, in the requested dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.config.errors import ModelLoadError
from pdserve.config.model import ModelConfig
from pdserve.loader.hf_folder import iter_tensors, read_config
from pdserve.model.decoder import DecoderModel
from pdserve.model.tensor_parallel import TensorParallel
from pdserve.utils.dtype_names import cpu_has_native_bf16

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return _named_dtype(name, "dtype")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto`: the model's dtype."""
    return model_dtype if name == "auto" else _named_dtype(name, "KV cache dtype")


def _named_dtype(name: str, what: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown {what} {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_config(folder: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(read_config(folder))


def load_decoder(folder: Path, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None, quantization: str | None = None,
                 tp: TensorParallel | None = None) -> DecoderModel:
    """The model, or with `tp` this rank's part of it (only its slices are kept)."""
    config = load_config(folder)
    try:
        model = DecoderModel(config, dtype=dtype, device=device, max_positions=max_positions,
                             quantization=quantization, tp=tp)
    except RuntimeError as e:  # typically out of memory
        raise ModelLoadError(f"cannot allocate the model on {device}: {e}") from None
    model.load_weights(iter_tensors(folder, sliced=tp is not None and tp.size > 1))
    return model
