"""Tools and tool-call histories as the chat template sees them.

A template that renders tools itself (it names `tools`, as Qwen's and Hermes' do) gets them as the
`tools` variable, and assistant tool calls with their arguments as objects (what those templates
expect; OpenAI sends a JSON string). A template that does not (SmolLM2's, plain ChatML) gets the
Hermes prompt below in the system message, assistant calls as `<tool_call>` text and tool results as
`<tool_response>` user turns: the format the `hermes` parser reads back. Only that parser exists so
far: a template that teaches another call format (Llama 3.1's `<|python_tag|>`) needs its own parser
for `auto`.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}"
    "\n</tool_call>"
)


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native: bool
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for a request with these tools (None: none offered)."""
    if native:
        out = [_native(m) for m in messages]
        return out, ({"tools": tools} if tools else {})
    out = [_fallback(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _arguments(call: dict[str, Any]) -> Any:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args


def _native(m: dict[str, Any]) -> dict[str, Any]:
    m = {**m, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        m["tool_calls"] = [{**c, "function": {**(c.get("function") or {}), "arguments": _arguments(c)}}
                           for c in m["tool_calls"]]
    return m


def _fallback(m: dict[str, Any]) -> dict[str, Any]:
    role, content = m["role"], m.get("content") or ""
    if role == "assistant" and m.get("tool_calls"):
        calls = [json.dumps({"name": (c.get("function") or {}).get("name"), "arguments": _arguments(c)},
                            ensure_ascii=False) for c in m["tool_calls"]]
        text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        return {"role": "assistant", "content": f"{content}\n{text}".lstrip("\n")}
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": role, "content": content}
