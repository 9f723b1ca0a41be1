"""pdserve: LLM serving with prefill/decode disaggregation."""

from pdserve.llm import LLM
from pdserve.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]
