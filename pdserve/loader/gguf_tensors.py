"""A GGUF file's tensors by Hugging Face name, read through the file's memory map, quantized ones kept quantized.

Tensors of a block format the kernels take (gguf_blocks.FORMATS) come as QuantizedMatrix; F32/F16/BF16 tensors as
torch tensors (the model copies them into its dtype); any other block format (Q2_K, Q3_K, the IQ formats) is
dequantized here to float32, said once per format in the log.

The tensor table is read by `tensor_index`, which skips the metadata instead of decoding it: gguf-py's reader
builds a numpy view per tokenizer string: 6.7 s of the embedded model's 8.8 s load under cProfile, 0.9 s in all
without it (the converted folder already holds what the metadata says).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.config.errors import ModelLoadError
from pdserve.loader.gguf_blocks import FORMATS, from_gguf
from pdserve.loader.gguf_convert import hf_name, needs_unpermute, norm_offset, unpermute

log = logging.getLogger("pdserve.loader")

_DENSE = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}


def iter_gguf_tensors(gguf_path: Path, folder: Path) -> Iterator[tuple[str, Any]]:
    """(HF name, QuantizedMatrix or torch tensor) for every tensor of the file; `folder` is its converted
    folder (config.json gives the head counts the Q/K rows are unpermuted by)."""
    import torch

    config = json.loads((folder / "config.json").read_text())
    arch = config["model_type"]
    widened: set[str] = set()
    for t in tensor_index(gguf_path):
        name = hf_name(t.name, arch)
        kind = t.type_name
        shape = t.shape
        heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        if kind in FORMATS and len(shape) == 2:
            matrix = from_gguf(kind, t.data, shape)  # type: ignore[arg-type]
            if needs_unpermute(arch, name):
                matrix = matrix.permute_rows(unpermute(np.arange(shape[0]), heads))
            yield name, matrix
            continue
        if kind in _DENSE:
            data = np.ascontiguousarray(t.data)
            tensor = (torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16) if kind == "BF16"
                      else torch.from_numpy(data.view(_DENSE[kind]).copy()))
            tensor = tensor.reshape(shape)
        else:
            tensor = torch.from_numpy(_dequantized(t, kind, widened)).reshape(shape)
        if needs_unpermute(arch, name):
            tensor = torch.from_numpy(unpermute(tensor.float().numpy(), heads)).to(tensor.dtype)
        if offset := norm_offset(arch, name):
            tensor = tensor.float() - offset
        yield name, tensor


def _dequantized(t: TensorEntry, kind: str, widened: set[str]) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if kind not in widened:
        widened.add(kind)
        log.warning("GGUF tensors of type %s have no packed kernel: dequantized to float at load", kind)
    try:
        return np.asarray(dequantize(t.data, GGMLQuantizationType[kind]), dtype=np.float32)
    except NotImplementedError:
        raise ModelLoadError(f"GGUF tensor type {kind} ({t.name}) is not supported") from None


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str  # GGML's type name: F32, Q4_K, ...
    shape: tuple[int, ...]  # outermost first, as numpy and torch have it
    data: np.ndarray  # the tensor's bytes in the file's memory map: [rows, bytes per row] (uint8)


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


def tensor_index(gguf_path: Path) -> list[TensorEntry]:
    """The file's tensors (name, type, shape, bytes), reading past the metadata without decoding it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)  # type: ignore[arg-type]
    try:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ModelLoadError(f"{gguf_path} is not a GGUF file of version 2 or later")
        at, alignment = 24, 32
        for _ in range(n_kv):
            key, at = _string(buf, at)
            (kind,), at = struct.unpack_from("<I", buf, at), at + 4
            if key == "general.alignment":
                alignment = struct.unpack_from("<I", buf, at)[0]
            at = _skip_value(buf, at, kind)
        entries = []
        for _ in range(n_tensors):
            name, at = _string(buf, at)
            (dims,), at = struct.unpack_from("<I", buf, at), at + 4
            sizes = struct.unpack_from(f"<{dims}Q", buf, at)
            at += 8 * dims
            kind, offset = struct.unpack_from("<IQ", buf, at)
            at += 12
            entries.append((name, GGMLQuantizationType(kind), tuple(reversed(sizes)), offset))
    except (struct.error, ValueError) as e:
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file ({e})") from None
    start = (at + alignment - 1) // alignment * alignment
    index = []
    for name, kind, shape, offset in entries:
        block, size = GGML_QUANT_SIZES[kind]
        row_bytes = shape[-1] // block * size
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = raw[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        index.append(TensorEntry(name, kind.name, shape, data))
    return index


def _string(buf: memoryview, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, at)
    return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n


def _skip_value(buf: memoryview, at: int, kind: int) -> int:
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item in _SCALAR_BYTES:
            return at + count * _SCALAR_BYTES[item]
        for _ in range(count):
            at = _skip_value(buf, at, item)
        return at
    return at + _SCALAR_BYTES[kind]
