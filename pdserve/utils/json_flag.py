"""Flags that take vLLM's JSON objects (--speculative-config, --kv-events-config): parsed into a msgspec
struct, an unknown key an error that names it, never ignored."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


def json_struct(value: str | dict[str, Any] | T | None, flag: str, cls: type[T], known: tuple[str, ...],
                prepare: Callable[[dict], dict] = lambda d: d) -> T | None:
    """From the flag's JSON text, a dict (the offline LLM's keyword) or a struct already; `prepare` fills in
    what vLLM derives from other keys."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    if unknown := sorted(set(value) - set(known)):
        raise ValueError(f"{flag}: {', '.join(unknown)} not supported (pdserve takes {', '.join(known)})")
    try:
        return msgspec.convert(prepare(value), cls)
    except msgspec.ValidationError as e:
        raise ValueError(f"{flag}: {e}") from None
