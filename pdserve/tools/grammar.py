"""The grammar that makes `tool_choice` `required` or a named function hold: the answer is one (or,
with parallel_tool_calls, several) Hermes `<tool_call>` blocks whose JSON has a listed function's
name and arguments valid for its parameters, compact (no free whitespace: see structured/spec.py)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.structured.spec import StructuredOutput

COMPACT = {"whitespace_flexible": False}


def tool_call_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> StructuredOutput:
    """`only`: the one function to call (a named tool_choice); None: any of `tools` (`required`)."""
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": COMPACT}
    repeat = ' ("\\n" call)*' if parallel and only is None else ""
    lark = (f"start: call{repeat}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutput(kind="lark", value=lark)
