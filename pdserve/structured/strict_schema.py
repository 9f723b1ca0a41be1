"""Closed JSON schemas, as xgrammar's strict mode (vLLM's default backend) and OpenAI's strict function
calling read them: an object admits only its declared properties unless it says `additionalProperties`
(true or a schema), and an array with `prefixItems` only those items unless it says `items`.

JSON Schema itself leaves both open, and a small model takes the door: asked for `add(a, b)` it wrote
`{"a":1,"b":2,"c":3}` and then a call with one more key each time until max_tokens.

Branches of an `allOf` with more than one entry are left open (and so are the `$defs` they name):
closing each branch of an intersection would refuse every key the other branches declare.
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")


def close_schema(schema: Any) -> Any:
    """A copy of `schema` with every object and tuple closed where the schema is silent."""
    return _close(schema, _intersected_refs(schema), close_here=True)


def _close(node: Any, keep_open: set[str], close_here: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, keep_open, close_here=not _is_kept(key, name, keep_open))
                        for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub, keep_open, close_here=True) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        single = len(out["allOf"]) == 1
        out["allOf"] = [_close(sub, keep_open, close_here=single) for sub in out["allOf"]]
    for key in _SCHEMA_VALUES:
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = _close(value, keep_open, close_here=True)
        elif key == "items" and isinstance(value, list):  # draft 4's tuples
            out[key] = [_close(sub, keep_open, close_here=True) for sub in value]
    if close_here and "allOf" not in out:
        _close_node(out)
    return out


def _close_node(out: dict[str, Any]) -> None:
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    if isinstance(out.get("items"), list) and "additionalItems" not in out:
        out["additionalItems"] = False


def _is_kept(key: str, name: str, keep_open: set[str]) -> bool:
    return key in ("$defs", "definitions") and f"#/{key}/{name}" in keep_open


def _intersected_refs(node: Any) -> set[str]:
    """The `$ref`s that are branches of an allOf of several entries, anywhere in `node`."""
    found: set[str] = set()
    if isinstance(node, dict):
        branches = node.get("allOf")
        if isinstance(branches, list) and len(branches) > 1:
            found |= {b["$ref"] for b in branches if isinstance(b, dict) and isinstance(b.get("$ref"), str)}
        for value in node.values():
            found |= _intersected_refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _intersected_refs(value)
    return found
