"""Find a model's files: the embedded default, a GGUF file, or a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

from pdserve.config.errors import ModelLoadError
from pdserve.loader.default_model import DEFAULT_MODEL_NAME, PACKAGED_NAME, names_packaged, source_path


def resolve_model_folder(model: str | Path | None, with_weights: bool = False) -> Path:
    """The HF-style folder to read `model`'s config and tokenizer from; a GGUF file's is converted (and cached)
    first, its weights dequantized into it only `with_weights` (the `--quantization none` path)."""
    path = source_path(model)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or a Hugging Face folder")
        from pdserve.loader.gguf_convert import converted_folder

        return converted_folder(path, with_weights)
    return path


def tensor_parallel_refusal(model: str | Path | None, ranks: int) -> str | None:
    """Why `model` cannot be split over `ranks` tensor-parallel ranks, naming the numbers (None: it can).
    Read from config.json alone, before any process loads weights."""
    if ranks == 1:
        return None
    from pdserve.config.model import ModelConfig
    from pdserve.loader.hf_folder import read_config

    return ModelConfig.from_hf_dict(read_config(resolve_model_folder(model))).tensor_parallel_refusal(ranks)


def model_name(model: str | Path | None) -> str:
    """The name a server reports for `model` (as in /v1/models)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    if names_packaged(model):
        return PACKAGED_NAME
    path = Path(model)
    return path.stem if path.is_file() else path.name


__all__ = ["ModelLoadError", "model_name", "resolve_model_folder", "tensor_parallel_refusal"]
