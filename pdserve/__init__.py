"""pdserve: LLM serving with prefill/decode disaggregation.

`LLM` and `SamplingParams` load on first use: the router, the API server and the engine process import
this package too, and must not pay for torch (only the processes that compute load it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pdserve.config.lora import LoRARequest
    from pdserve.offline.llm import LLM
    from pdserve.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.offline.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.sampling.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from pdserve.config.lora import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
