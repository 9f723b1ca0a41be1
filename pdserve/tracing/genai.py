"""Span attribute names: OpenTelemetry's GenAI semantic conventions (the current `gen_ai.usage.input_tokens`, not
the older `prompt_tokens`), then pdserve's own under `pdserve.`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPERATION = "gen_ai.operation.name"  # chat, text_completion
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_CHOICES = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"

PROVIDER_NAME = "pdserve"

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/responses": "chat"}


def span_name(operation: str, model: str | None) -> str:
    """The conventions' name: `{operation} {model}`."""
    return f"{operation} {model}" if model else operation


def request_attributes(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """What an OpenAI request body says of itself, under the conventions' names (absent fields are left out)."""
    attributes: dict[str, Any] = {OPERATION: OPERATIONS.get(path, "chat"), PROVIDER: PROVIDER_NAME}
    fields = ((REQUEST_MODEL, "model", str), (REQUEST_TEMPERATURE, "temperature", float),
              (REQUEST_TOP_P, "top_p", float), (REQUEST_SEED, "seed", int), (REQUEST_CHOICES, "n", int))
    for name, key, kind in fields:
        value = body.get(key)
        if isinstance(value, bool) or value is None:
            continue
        if kind is float and isinstance(value, int):
            value = float(value)
        if isinstance(value, kind):
            attributes[name] = value
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        attributes[REQUEST_MAX_TOKENS] = max_tokens
    return attributes
