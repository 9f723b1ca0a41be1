"""A GGUF file's tensors by Hugging Face name, read through the file's memory map, quantized ones kept quantized.

Tensors of a block format the kernels take (gguf_blocks.FORMATS) come as QuantizedMatrix; F32/F16/BF16 tensors as
torch tensors (the model copies them into its dtype); any other block format (Q2_K, Q3_K, the IQ formats) is
dequantized here to float32, said once per format in the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.config.errors import ModelLoadError
from pdserve.loader.gguf_blocks import FORMATS, QuantizedMatrix, from_gguf
from pdserve.loader.gguf_convert import architecture, hf_name, needs_unpermute, open_gguf, unpermute

log = logging.getLogger("pdserve.loader")

_DENSE = {"F32": np.float32, "F16": np.float16, "BF16": None}


def iter_gguf_tensors(gguf_path: Path, folder: Path) -> Iterator[tuple[str, Any]]:
    """(HF name, QuantizedMatrix or torch tensor) for every tensor of the file; `folder` is its converted
    folder (config.json gives the head counts the Q/K rows are unpermuted by)."""
    import torch

    reader = open_gguf(gguf_path)
    arch = architecture(reader, gguf_path)
    config = json.loads((folder / "config.json").read_text())
    widened: set[str] = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        kind = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        if kind in FORMATS and len(shape) == 2:
            matrix = from_gguf(kind, t.data, shape)  # type: ignore[arg-type]
            if needs_unpermute(arch, name):
                matrix = matrix.permute_rows(unpermute(np.arange(shape[0]), heads))
            yield name, matrix
            continue
        if kind in _DENSE:
            data = np.asarray(t.data)
            tensor = (torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16) if kind == "BF16"
                      else torch.from_numpy(np.array(data, dtype=_DENSE[kind])))
            tensor = tensor.reshape(shape)
        else:
            tensor = torch.from_numpy(_dequantized(t, kind, widened)).reshape(shape)
        if needs_unpermute(arch, name):
            tensor = torch.from_numpy(unpermute(tensor.float().numpy(), heads)).to(tensor.dtype)
        yield name, tensor


def _dequantized(t: Any, kind: str, widened: set[str]) -> np.ndarray:
    from gguf.quants import dequantize

    if kind not in widened:
        widened.add(kind)
        log.warning("GGUF tensors of type %s have no packed kernel: dequantized to float at load", kind)
    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ModelLoadError(f"GGUF tensor type {kind} ({t.name}) is not supported") from None


def is_quantized(tensor: Any) -> bool:
    return isinstance(tensor, QuantizedMatrix)
