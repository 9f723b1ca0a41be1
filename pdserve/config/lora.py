"""The adapters an instance serves, as vLLM's `--lora-modules` names them (torch-free: the API server and
the router read these too).

    --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}'

A LoRA request names its adapter in the `model` field; its prompt's KV is its own (the prefix cache keys
every block by adapter, lora_hash_root), so a base prefix never serves an adapter request or the reverse.
"""

from __future__ import annotations

import hashlib
import json

import msgspec

RUNTIME_LOADING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for /v1/load_lora_adapter


class LoRAModule(msgspec.Struct, frozen=True):
    name: str
    path: str
    base_model_name: str | None = None


class LoRARequest(msgspec.Struct, frozen=True):
    """vLLM's offline handle on an adapter: `LLM.generate(..., lora_request=LoRARequest("sql", 1, "/path"))`
    (the id is vLLM's; adapters are known by name here)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


def lora_module(text: str) -> LoRAModule:
    """NAME=PATH, or vLLM's JSON form."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return msgspec.convert(json.loads(text), LoRAModule)
        except (ValueError, msgspec.ValidationError) as e:
            raise ValueError(f"--lora-modules: {text!r} is not a JSON object with name and path: {e}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes NAME=PATH (or JSON with name and path), got {text!r}")
    return LoRAModule(name, path)


def as_lora_module(value: LoRAModule | dict | str) -> LoRAModule:
    """A module as the config holds it, from a flag's text, a decoded config's dict, or itself."""
    if isinstance(value, LoRAModule):
        return value
    return msgspec.convert(value, LoRAModule) if isinstance(value, dict) else lora_module(value)


def lora_hash_root(lora_name: str | None) -> bytes | None:
    """The parent of a prompt's first KV block hash (block_pool.hash_block): None for the base model, so
    its hashes are as before; an adapter's blocks hash apart from the base's and from every other adapter's."""
    return None if lora_name is None else hashlib.sha256(b"lora:" + lora_name.encode()).digest()
