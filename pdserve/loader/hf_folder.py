"""Read a Hugging Face model folder: config.json and one or many safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.config.errors import ModelLoadError

if TYPE_CHECKING:  # read_config is used where torch is not loaded (the engine)
    import torch


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; expected a Hugging Face model folder or a .gguf file")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return cfg


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} is missing shard(s) listed in its index: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (.bin checkpoints are not supported)")
    return files


def iter_tensors(folder: Path, sliced: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; `sliced`: as safetensors slices, read only where indexed (a
    tensor-parallel rank reads its part of each weight, never the whole)."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name) if sliced else f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is not a readable safetensors file ({e})") from None
