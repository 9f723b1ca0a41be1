"""The OpenAI generation endpoints: /v1/completions, /v1/chat/completions, /v1/responses."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request

from pdserve.api.answers import chat_choice, completion_choice
from pdserve.api.generation import AnswerShape, Generation
from pdserve.api.handling import (
    chat_prompt,
    check_length,
    check_model,
    completion_prompt,
    migrate,
    pd_params,
    prompt_text,
    pull_hint,
    respond,
    sampling_params,
    structured_output,
    template_ids,
    tool_grammar,
)
from pdserve.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice
from pdserve.api.responses_api import ResponsesRequest
from pdserve.api.responses_api import new_id as new_response_id
from pdserve.api.state import APIError, ServerDep
from pdserve.tool_calling.parsers import PARSERS

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request, state: ServerDep) -> Any:
    lora = check_model(state, body.model)
    prompt_ids = completion_prompt(state, body)
    shape = AnswerShape(echo=body.echo, return_generated=body.max_tokens != 0,
                        prompt_logprobs_field=body.prompt_logprobs is not None, echo_text=prompt_text(body))
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt carries its logprobs
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    structured = await structured_output(state, body)
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens  # echo-only: one token computed, none shown
    params = sampling_params(state, body, max_tokens, body.logprobs, structured, prompt_logprobs=prompt_logprobs)
    gen = Generation(f"cmpl-{uuid.uuid4().hex}", prompt_ids, pd=pd_params(body), shape=shape, lora_name=lora,
                     kv_pull=pull_hint(state, body))
    params = migrate(state, body, gen, params)
    return await respond(state, raw, body, gen, params, "text_completion", completion_choice)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request, state: ServerDep) -> Any:
    lora = check_model(state, body.model)
    prompt_ids = chat_prompt(state, body)
    check_length(state, prompt_ids)
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    structured = await structured_output(state, body)
    shape = AnswerShape(prompt_logprobs_field=body.prompt_logprobs is not None)
    if body.tools and body.tool_choice != "none":
        shape.tool_parser = PARSERS[state.tool_call_parser]
        shape.max_tool_calls = None if body.parallel_tool_calls else 1
        forced = body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
        if forced and structured is not None:
            raise APIError("tool_choice required or a named function cannot be combined with "
                           "response_format or structured_outputs", param="tool_choice")
        if structured is None:  # under auto, a client's own constraint stands instead of the calls' grammar
            structured, shape.tools_forced = await tool_grammar(state, body, forced), forced
    params = sampling_params(state, body, max_tokens, logprobs, structured)
    gen = Generation(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, pd=pd_params(body), shape=shape, lora_name=lora,
                     kv_pull=pull_hint(state, body))
    params = migrate(state, body, gen, params)
    return await respond(state, raw, body, gen, params, "chat.completion", chat_choice)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, raw: Request, state: ServerDep) -> Any:
    lora = check_model(state, body.model)
    if body.migration is not None:
        raise APIError("migration is served on /v1/completions and /v1/chat/completions", param="migration")
    messages = [ChatMessage(**m) for m in body.messages()]
    prompt_ids = template_ids(state, messages, True, None, None)
    check_length(state, prompt_ids)
    params = sampling_params(state, body, body.max_output_tokens, None, await structured_output(state, body))
    gen = Generation(new_response_id(), prompt_ids, pd=pd_params(body), lora_name=lora,
                     kv_pull=pull_hint(state, body))
    return await respond(state, raw, body, gen, params, "response", None, responses_api=True)
