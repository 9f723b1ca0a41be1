"""`--speculative-config`: vLLM's JSON, the n-gram method only (no draft model is built yet)."""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.utils.json_flag import json_struct

KNOWN_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5  # vLLM's defaults when neither is given
    prompt_lookup_min: int = 5
    # vLLM's key: with more decoding sequences than this, no step speculates, and up to it every step does.
    # None: each step decides from measurement (spec_decode/controller.py).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"method {self.method!r} is not served; pdserve speculates "
                             "with \"ngram\" (prompt lookup) only")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")


def speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """From the flag's JSON text, a dict (LLM(speculative_config=...)) or a config; unknown keys are an
    error, not ignored."""
    return json_struct(value, "--speculative-config", SpeculativeConfig, KNOWN_KEYS, _lookup_lengths)


def _lookup_lengths(value: dict) -> dict:
    for given, missing in (("prompt_lookup_max", "prompt_lookup_min"), ("prompt_lookup_min", "prompt_lookup_max")):
        if given in value and missing not in value:  # vLLM's rule: the one given stands for both
            value = {**value, missing: value[given]}
    return value
