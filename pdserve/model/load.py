"""Build a DecoderModel from a model folder, on any device, in the requested dtype."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pdserve.config.errors import ModelLoadError
from pdserve.config.model import ModelConfig
from pdserve.loader.gguf_blocks import quantize
from pdserve.loader.gguf_tensors import iter_gguf_tensors
from pdserve.loader.hf_folder import iter_tensors, read_config
from pdserve.loader.quantization import QUANTIZE_AT_LOAD
from pdserve.model.decoder import DecoderModel
from pdserve.model.tensor_parallel import TensorParallel
from pdserve.utils.dtype_names import cpu_has_native_bf16, kv_cache_dtype_name

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return _named_dtype(name, "dtype")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> str:
    """The cache dtype's name (kv/layout.py): `auto` is the model's dtype; fp8 / fp8_e5m2 / int8 are 8-bit codes."""
    return kv_cache_dtype_name(name, str(model_dtype).removeprefix("torch."))


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
                 tp: TensorParallel | None = None, gguf_file: Path | None = None) -> DecoderModel:
    """The model, or with `tp` this rank's part of it (only its slices are kept). `quantization` as
    loader/quantization.py resolves it; "gguf" reads `gguf_file`'s tensors in their block formats."""
    raw = read_config(folder)
    config = ModelConfig.from_hf_dict(raw)
    try:
        model = DecoderModel(config, dtype=dtype, device=device, max_positions=max_positions,
                             quantization=quantization, tp=tp)
    except RuntimeError as e:  # typically out of memory
        raise ModelLoadError(f"cannot allocate the model on {device}: {e}") from None
    tensors = _tensors(folder, quantization, tp, gguf_file)
    if raw.get("model_type") in MULTIMODAL_TYPES:
        tensors = _text_decoder_tensors(tensors)
    model.load_weights(tensors)
    return model


MULTIMODAL_TYPES = ("gemma3",)  # checkpoints whose text decoder is served, the vision side left out
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}  # transformers v5's and v4's names
_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")


def _text_decoder_tensors(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A multimodal checkpoint's text decoder under the text model's names; its vision tower is not served."""
    for name, tensor in tensors:
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        yield (_TEXT_PREFIXES[prefix] + name[len(prefix):] if prefix else name), tensor


def _tensors(folder: Path, quantization: str | None, tp: TensorParallel | None,
             gguf_file: Path | None) -> Iterator[tuple[str, Any]]:
    if quantization == "gguf":
        if gguf_file is None:
            raise ModelLoadError("--quantization gguf needs the .gguf file")
        return iter_gguf_tensors(gguf_file, folder)
    if quantization in QUANTIZE_AT_LOAD:
        return _quantized_at_load(iter_tensors(folder), QUANTIZE_AT_LOAD[quantization])
    return iter_tensors(folder, sliced=tp is not None and tp.size > 1)


def _quantized_at_load(tensors: Iterator[tuple[str, torch.Tensor]], fmt: str) -> Iterator[tuple[str, Any]]:
    """Every projection and token table in `fmt` (norms and biases as they are)."""
    for name, tensor in tensors:
        if name.endswith(".weight") and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
            yield name, quantize(tensor.float().numpy(), fmt)
        else:
            yield name, tensor
