"""The offline API: `LLM` (vLLM-shaped batch generation through the engine process) and its outputs."""
