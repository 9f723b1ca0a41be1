"""What an instance does with a request (`--splitwise-role`)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    MIXED = "mixed"  # whole requests
    PREFILL = "prefill"  # prompts; the KV goes to a decode instance
    DECODE = "decode"  # the rest of a request whose prompt a prefill instance computed
