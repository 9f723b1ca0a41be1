"""The model runtime: one Llama-family decoder (decoder.py) over a paged KV cache, its configuration
(config.py, torch-free: the engine reads it to size the cache), RoPE, linears and attention.

The names below load on first use, so that `pdserve.config.model` stays importable without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {"DecoderModel": "decoder", "ForwardBatch": "forward_batch", "SequenceChunk": "forward_batch",
            "default_device": "load", "load_config": "load", "load_decoder": "load", "resolve_dtype": "load"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve.model' has no attribute {name!r}")
    return getattr(import_module(f"pdserve.model.{_EXPORTS[name]}"), name)
