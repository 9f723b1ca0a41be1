"""The grammar of an answer with tool calls: Hermes `<tool_call>` blocks of `{"name":...,"arguments":...}` with
a listed function's name and arguments valid for its parameters, compact (no free whitespace: see
structured/spec.py). `tool_choice` required or a named function: the answer is one call (or, with
parallel_tool_calls, several); `auto`: free text, or text up to a first block and then calls.

Each function's parameters are a JSON schema of their own (its own root), so their `$ref`s to `#/$defs/...`
resolve as the client wrote them (pydantic's nested models). They compile closed (strict_schema.py) unless the
function says `strict: false`: OpenAI's strict function calling requires closed objects, and without them a
small model invents one more key per call."""

from __future__ import annotations

import json
from typing import Any

from pdserve.structured.strict_schema import close_schema

COMPACT = {"whitespace_flexible": False}
BLOCK_OPEN, BLOCK_CLOSE = "<tool_call>", "</tool_call>"  # Hermes blocks: the parsers read what this writes
START, END, BETWEEN = BLOCK_OPEN + "\n", "\n" + BLOCK_CLOSE, "\n"
# Text without a block start; text up to and including the first one
TEXT = r"/(.|\n)+/ & ~/(.|\n)*<tool_call>(.|\n)*/"
OPEN = r"/(.|\n)*<tool_call>\n/ & ~/(.|\n)*<tool_call>(.|\n)*<tool_call>(.|\n)*/"


def tool_call_lark(value: dict[str, Any]) -> str:
    """The Lark grammar (llguidance's dialect) for a `tool_calls` spec's value."""
    rules = []
    for i, f in enumerate(value["functions"]):
        head = json.dumps(f'{{"name":{json.dumps(f["name"])},"arguments":')
        parameters = f.get("parameters") or {"type": "object"}
        if f.get("strict") is not False:
            parameters = close_schema(parameters)
        schema = {**parameters, "x-guidance": COMPACT} if isinstance(parameters, dict) else parameters
        rules.append(f'call_{i}: {head} args_{i} "}}"\nargs_{i}: %json {json.dumps(schema)}')
    calls = " | ".join(f"call_{i}" for i in range(len(value["functions"])))
    more = f" ({json.dumps(BETWEEN + START)} call {json.dumps(END)})*" if value["parallel"] else ""
    if value["forced"]:
        start = f"start: {json.dumps(START)} call {json.dumps(END)}{more}"
    else:
        start = f"start: TEXT?\n    | OPEN call {json.dumps(END)}{more}\nTEXT: {TEXT}\nOPEN: {OPEN}"
    return f"{start}\ncall: {calls}\n" + "\n".join(rules) + "\n"
