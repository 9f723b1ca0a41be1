"""The grammar that makes `tool_choice` `required` or a named function hold: the answer is one (or,
with parallel_tool_calls, several) Hermes `<tool_call>` blocks of `{"name":...,"arguments":...}` with
a listed function's name and arguments valid for its parameters, compact (no free whitespace: see
structured/spec.py). Each function's parameters are a JSON schema of their own (its own root), so
their `$ref`s to `#/$defs/...` resolve as the client wrote them (pydantic's nested models)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.structured.spec import StructuredOutput

COMPACT = {"whitespace_flexible": False}


def tool_call_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> StructuredOutput:
    """`only`: the one function to call (a named tool_choice); None: any of `tools` (`required`)."""
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    rules = []
    for i, f in enumerate(functions):
        head = json.dumps(f'<tool_call>\n{{"name":{json.dumps(f["name"])},"arguments":')
        schema = {**(f.get("parameters") or {"type": "object"}), "x-guidance": COMPACT}
        rules.append(f'call_{i}: {head} args_{i} "}}\\n</tool_call>"\nargs_{i}: %json {json.dumps(schema)}')
    repeat = ' ("\\n" call)*' if parallel and only is None else ""
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    lark = f"start: call{repeat}\ncall: {calls}\n" + "\n".join(rules) + "\n"
    return StructuredOutput(kind="lark", value=lark)
