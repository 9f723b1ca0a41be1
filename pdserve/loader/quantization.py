"""Which weights a worker computes with, from `--quantization` and the model's source.

- `gguf` (the default for a .gguf file): every tensor in the file's own block format, packed for the kernels.
- `none` (the default for a Hugging Face folder): the weights dequantized to `--dtype`; the exact path the
  transformers oracle is compared with.
- `q8_0`, `q4_0`: a Hugging Face folder quantized at load into those GGUF block formats (round to nearest per
  block), then computed on as a GGUF file's would be.
- `w8a8`: int8 weights per output channel and dynamic int8 activations (fbgemm), from dequantized weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve.config.errors import ModelLoadError
from pdserve.config.quantization import QUANTIZATION_CHOICES
from pdserve.loader.default_model import source_path

log = logging.getLogger("pdserve.loader")

QUANTIZE_AT_LOAD = {"q8_0": "Q8_0", "q4_0": "Q4_0"}


def model_source(model: str | Path | None) -> Path:
    """The file or folder `model` names (the embedded default's GGUF for None)."""
    return source_path(model)


def is_gguf(model: str | Path | None) -> bool:
    source = model_source(model)
    return source.is_file() and source.suffix.lower() == ".gguf"


def requested_quantization(requested: str | None, model: str | Path | None) -> str:
    """The flag's value with its default filled in (no device considered): what the KV fingerprint names."""
    if requested is None:
        return "gguf" if is_gguf(model) else "none"
    return requested


def resolve_quantization(requested: str | None, model: str | Path | None, device_type: str) -> str | None:
    """The path the worker loads: "gguf", "q8_0", "q4_0", "w8a8" or None (dense weights in the model dtype)."""
    chosen = requested_quantization(requested, model)
    if chosen not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"--quantization {chosen!r}: choose one of {', '.join(QUANTIZATION_CHOICES)}")
    gguf = is_gguf(model)
    if chosen == "gguf" and not gguf:
        raise ModelLoadError("--quantization gguf needs a .gguf file; a Hugging Face folder is quantized at load "
                             "with --quantization q8_0 or q4_0")
    if chosen in QUANTIZE_AT_LOAD and gguf:
        raise ModelLoadError(f"--quantization {chosen} quantizes a Hugging Face folder at load; a GGUF file is "
                             "served in its own block formats (gguf, the default) or dequantized (none)")
    if chosen in ("gguf", *QUANTIZE_AT_LOAD) and device_type != "cpu":
        log.warning("--quantization %s: no %s kernel for GGUF block formats yet; the weights are dequantized to "
                    "the model dtype at load", chosen, device_type)
        return None
    return None if chosen == "none" else chosen
