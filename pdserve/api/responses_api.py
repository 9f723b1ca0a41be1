"""OpenAI's Responses API (`POST /v1/responses`) for text: `input` (a string or messages), `instructions`,
`max_output_tokens`, `text.format` (json_object / json_schema, as structured outputs), streamed as
Responses events or whole. Nothing is stored, so `previous_response_id` is a 400, as are tools,
reasoning and background mode (see REFUSED_HERE); the chat endpoint serves tools.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.api.answers import whole_answer_deltas
from pdserve.api.generation import Generation, generate_choices
from pdserve.api.protocol import JsonSchemaFormat, ResponseFormat, _SamplingFields
from pdserve.api.state import APIError, ServerState
from pdserve.engine.engine_client import EngineError
from pdserve.http.errors import error_body

REFUSED_HERE = {
    "previous_response_id": "previous_response_id needs stored responses; this server stores none: send the "
                            "whole conversation as input",
    "conversation": "conversations are not stored; send the whole conversation as input",
    "tools": "tools are served on /v1/chat/completions, not on /v1/responses",
    "reasoning": "reasoning is not supported: the served model does not reason",
    "background": "background responses are not supported",
    "include": "include is not supported",
    "top_logprobs": "logprobs are served on /v1/chat/completions and /v1/completions",
    "prompt_logprobs": "prompt logprobs are served on /v1/chat/completions and /v1/completions",
    "n": "a response has one answer here; n > 1 is served on /v1/chat/completions",
    "continue_final_message": "continue_final_message is served on /v1/chat/completions",
}
NEUTRAL_HERE = {"n": 1}
TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: str = "text"
    name: str = "response"
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat = TextFormat()


class ResponsesRequest(_SamplingFields):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    text: TextConfig | None = None
    tool_choice: str | None = None  # "none" / "auto" with no tools: nothing to do

    @model_validator(mode="before")
    @classmethod
    def _refuse_here(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in REFUSED_HERE.items():
                if data.get(name) not in (None, [], False, NEUTRAL_HERE.get(name)):
                    raise PydanticCustomError("refused_field", "{field}: {why}", {"field": name, "why": why})
        return data

    @model_validator(mode="after")
    def _text_format(self) -> ResponsesRequest:
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type not in ("text", "json_object", "json_schema"):
            raise ValueError(f"text.format.type must be text, json_object or json_schema, not {fmt.type!r}")
        if fmt is not None and fmt.type != "text":
            self.response_format = ResponseFormat(type=fmt.type, json_schema=JsonSchemaFormat(
                name=fmt.name, schema=fmt.json_schema, strict=fmt.strict) if fmt.type == "json_schema" else None)
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages: instructions as the system message, then the input."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if item.get("type", "message") != "message" or "role" not in item:
                raise APIError(f"input[{i}]: only message items are supported, got {item.get('type')!r}",
                               param="input")
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item.get("content"), i)})
        return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content or []:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(f"input[{i}]: content parts must be text, got {kind!r}", param="input")
        texts.append(part.get("text", ""))
    return "\n".join(texts)


def _response(state: ServerState, body: ResponsesRequest, gen: Generation, text: str, status: str,
              finish: str | None) -> dict:
    message = {"type": "message", "id": gen.request_id.replace("resp_", "msg_"), "status": status,
               "role": "assistant", "content": [] if status == "in_progress" else
               [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
    usage = gen.usage()
    incomplete = status == "incomplete"
    return {
        "id": gen.request_id, "object": "response", "created_at": int(gen.created), "status": status,
        "model": gen.lora_name or state.model_name, "output": [] if status == "in_progress" else [message],
        "output_text": text, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and finish == "length" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": False,
        "tool_choice": body.tool_choice or "none", "tools": [], "store": False,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)} if body.text else
        {"format": {"type": "text"}},
        "metadata": getattr(body, "metadata", None) or {},
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"],
                  "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


async def respond_whole(state: ServerState, body: ResponsesRequest, gen: Generation, params: Any) -> dict:
    text, finish = "", None
    async for d in whole_answer_deltas(state, gen, params, 1):
        text += d.text
        finish = d.finish_reason or finish
    return _response(state, body, gen, text, _status(finish), finish)


async def respond_stream(state: ServerState, body: ResponsesRequest, gen: Generation, params: Any,
                         release: Any) -> AsyncIterator[str]:
    """Responses streaming events; the first (response.created) leaves with the first token."""
    seq = iter(range(1 << 30))
    item_id = gen.request_id.replace("resp_", "msg_")

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

    text, finish, outcome, opened = "", None, None, False
    try:
        async for d in generate_choices(state.engine, state.tokenizer, gen, params, 1):
            if not opened:
                opened = True
                opening = _response(state, body, gen, "", "in_progress", None)
                yield event("response.created", response=opening)
                yield event("response.in_progress", response=opening)
                yield event("response.output_item.added", output_index=0, item={
                    "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
                yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
            finish = d.finish_reason or finish
            if d.text:
                text += d.text
                yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                            delta=d.text, logprobs=[])
        done = _response(state, body, gen, text, _status(finish), finish)
        part = done["output"][0]["content"][0]
        yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                    logprobs=[])
        yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=done["output"][0])
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield event(kind, response=done)
    except (EngineError, ValueError) as e:
        outcome = "error"
        status = 500 if isinstance(e, EngineError) else 400
        yield event("error", **error_body(str(e), status)["error"])
    finally:
        await release(outcome)


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


