"""What the OpenAI routes do with a request around the engine: the prompt's token ids (text, chat
template, tools), the checks against the model, the output constraint (structured outputs, forced tool
calls), a migrated stream's resumption, and the answer, whole or streamed, within --max-concurrency."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from pdserve.admission.predictor import Refusal
from pdserve.api.answers import StreamRelease, complete, stream
from pdserve.api.generation import Generation
from pdserve.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice, Tool
from pdserve.api.responses_api import respond_stream, respond_whole
from pdserve.api.state import APIError, ServerState
from pdserve.engine.messages import PDParams
from pdserve.engine.prefix_pull import PullHint
from pdserve.http.disconnect import until_disconnect
from pdserve.http.wire import SENT_HEADER, parse_sent
from pdserve.structured.spec import StructuredOutput, check, grammar_tokenizer, tool_call_spec
from pdserve.tokenization.detokenizer import IncrementalDetokenizer
from pdserve.tool_calling.prompt import render_messages, template_supports_tools


def check_model(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter the request's `model` names (None: the base model); 404 for a model not served."""
    if model is None or model == state.model_name:
        return None
    if state.lora is not None and model in state.lora.adapters:
        return model
    served = [state.model_name, *(state.lora.adapters if state.lora is not None else [])]
    raise APIError(f"the model '{model}' does not exist; this server serves {', '.join(map(repr, served))}",
                   404, "model_not_found", param="model")


def check_length(state: ServerState, prompt_ids: list[int]) -> None:
    if not prompt_ids:
        raise APIError("the prompt is empty", param="prompt")
    if len(prompt_ids) >= state.max_model_len:
        raise APIError(f"the prompt has {len(prompt_ids)} tokens, but this model's maximum context length is "
                       f"{state.max_model_len} tokens", param="prompt")
    if any(not 0 <= t < state.tokenizer.vocab_size for t in prompt_ids):
        raise APIError("prompt token ids must be in [0, vocab size)", param="prompt")


def admit(state: ServerState, raw: Request, body: Any, gen: Generation, decodes: bool) -> None:
    engine = state.engine
    reports = engine.load_reports()
    verdict = state.admission.admit(raw, getattr(body, "user", None), reports, state.prompt_tokens_to_compute(gen),
                                    gen.priority, gen.created, decodes)
    if isinstance(verdict, Refusal):
        raise APIError(verdict.message, 429, verdict.error_type, headers={"Retry-After": verdict.retry_after_header})
    gen.admitted = verdict


def took(state: ServerState, raw: Request, body: Any, gen: Generation) -> None:
    """The request goes to the engine: counted in the load this server reports until the engine's own report
    has it, and acknowledged to the router that sent it."""
    decode_side = body.pd is not None and body.pd.role == "decode"  # its prompt is computed elsewhere
    todo = len(gen.prompt_token_ids)
    if state.prompt_work is not None:  # either side caches its blocks
        todo = state.prompt_work.handed_over(gen.prompt_token_ids, gen.lora_name)
    state.taken.add(0 if decode_side else todo, gen.priority)
    if sent := parse_sent(raw.headers.get(SENT_HEADER)):
        router, seq = sent
        state.acked[router] = max(seq, state.acked.get(router, 0))


def request_priority(state: ServerState, body: Any) -> int:
    """The `priority` field; as vLLM, one other than 0 is an error unless the engine orders by priority."""
    priority = getattr(body, "priority", 0)
    if priority and state.scheduling_policy != "priority":
        raise APIError(f"priority {priority} needs --scheduling-policy priority; this server serves in arrival order "
                       "(fcfs)", param="priority")
    return priority


def prompt_text(body: CompletionRequest) -> str | None:
    prompt = body.prompt if body.prompt_token_ids is None else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def completion_prompt(state: ServerState, body: CompletionRequest) -> list[int]:
    prompt = body.prompt_token_ids if body.prompt_token_ids is not None else body.prompt
    if prompt is None:
        raise APIError("either prompt or prompt_token_ids is required", param="prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise APIError("one prompt per request is supported; send several requests", param="prompt")
        prompt = prompt[0]
    ids = state.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens) if isinstance(prompt, str) \
        else list(prompt)
    check_length(state, ids)
    return ids


async def respond(state: ServerState, raw: Request, body: Any, gen: Generation, params: Any, kind: str,
                  make_choice: Any, responses_api: bool = False) -> Any:
    """The engine's answer, whole or streamed, once the request fits the context and the server has room."""
    if params.max_tokens is None:
        try:
            params = msgspec.structs.replace(params, max_tokens=max(state.max_model_len - len(gen.prompt_token_ids), 1))
        except ValueError as e:  # e.g. min_tokens above what the context leaves
            raise APIError(str(e)) from None
    elif len(gen.prompt_token_ids) + params.max_tokens > state.max_model_len:
        raise APIError(f"prompt ({len(gen.prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                       f"the maximum context length of {state.max_model_len}", param="max_tokens")
    gen.priority = request_priority(state, body)
    if not state.engine.healthy:
        raise APIError(state.engine.error or "the engine is down", 503, "service_unavailable")
    if state.weights_cleared:
        raise APIError("the model weights are cleared; POST /update_model_weight loads them", 503,
                       "service_unavailable")
    if state.in_flight >= state.max_concurrency:
        raise APIError(f"too many requests in flight (--max-concurrency {state.max_concurrency}); retry later",
                       429, "rate_limit_exceeded")
    # A PD side or a moved stream was admitted by the router already.
    if state.admission is not None and body.pd is None and getattr(body, "migration", None) is None:
        admit(state, raw, body, gen, decodes=params.max_tokens > 1)
    took(state, raw, body, gen)
    if state.tracing is not None:
        part = gen.pd.role if gen.pd is not None else "whole"
        # from now: a resumed answer's `created` is when the first instance took it
        gen.trace = state.tracing.start(raw.headers, body, kind, gen.request_id, time.time(), part)
    state.in_flight += 1
    state.metrics.request_started()
    if body.stream:
        release = StreamRelease(state, gen)
        # The generator's `finally` releases the slot; the background task covers a client that left
        # before the first chunk, when the generator never started and so never reaches `finally`.
        events = (respond_stream(state, body, gen, params, release) if responses_api
                  else stream(state, body, gen, params, kind, make_choice, release))
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(release))
    try:
        work = (respond_whole(state, body, gen, params) if responses_api
                else complete(state, body, gen, params, kind, make_choice))
        return await until_disconnect(raw, work)
    finally:
        state.in_flight -= 1


async def structured_output(state: ServerState, body: Any) -> StructuredOutput | None:
    """The request's output constraint, checked against the model's tokenizer (off the event loop: a
    large schema takes a while): a spec that does not compile is the client's 400."""
    try:
        spec = body.structured_spec()
        if spec is not None:
            await _check_off_loop(state, spec)
    except ValueError as e:
        raise APIError(f"the output constraint cannot be used: {e}", param=body.constraint_field()) from None
    return spec


async def _check_off_loop(state: ServerState, spec: StructuredOutput) -> None:
    """A client's own grammar may name tokens (`<|im_end|>`, `<[1234]>`): only the vocabulary can check
    those, so it is checked with llguidance's tokenizer (0.3 s and ~70 MB of this process, once). JSON
    schemas, regexes, choices and the tool-call grammars cannot, and are checked without it."""
    tokenizer = state.tokenizer

    def run() -> None:
        vocab = (grammar_tokenizer(tokenizer.folder / "tokenizer.json", None, tokenizer.eos_token_ids)
                 if spec.kind == "grammar" else None)
        check(spec, vocab)

    await asyncio.to_thread(run)


async def tool_grammar(state: ServerState, body: ChatCompletionRequest, forced: bool) -> StructuredOutput:
    """The grammar of the answer's tool calls: `forced` (tool_choice required or a named function) calls
    only; otherwise (auto) text, or text and then calls."""
    choice, tools = body.tool_choice, [t.model_dump(exclude_none=True) for t in body.tools or []]
    only = choice.name if isinstance(choice, NamedToolChoice) else None
    spec = tool_call_spec(tools, only, body.parallel_tool_calls, forced=forced)
    try:
        await _check_off_loop(state, spec)
    except ValueError as e:
        raise APIError(f"the tools' parameter schemas cannot be used: {e}", param="tools") from None
    return spec


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tools = body.tools if body.tool_choice != "none" else None
    ids = template_ids(state, body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs,
                       body.continue_final_message)
    tok = state.tokenizer
    if body.add_special_tokens and tok.add_bos_token and tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]  # vLLM's add_special_tokens on chat: the tokenizer's BOS before the template's
    return ids


def template_ids(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                 tools: list[Tool] | None, kwargs: dict | None, continue_final_message: bool = False) -> list[int]:
    dumped = [m.model_dump(exclude_none=True) for m in messages]
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    rendered, extra = render_messages(dumped, tool_dicts, template_supports_tools(state.tokenizer.chat_template))
    try:
        return state.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                   tokenize=True, continue_final_message=continue_final_message,
                                                   **extra, **(kwargs or {}))
    except Exception as e:  # the template raised on these messages
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None


def migrate(state: ServerState, body: Any, gen: Generation, params: Any) -> Any:
    """The router's `migration` field: name token ids in the stream; resume after the ones given."""
    migration = body.migration
    if migration is None:
        return params
    if body.n != 1:
        raise APIError("migration serves one choice (n = 1)", param="migration")
    gen.report_tokens = True
    done = migration.token_ids
    if not done:
        return params
    if any(not 0 <= t < state.tokenizer.vocab_size for t in done):
        raise APIError("migration.token_ids must be in [0, vocab size)", param="migration")
    if params.max_tokens is not None and len(done) >= params.max_tokens:
        raise APIError(f"migration resumes after {len(done)} tokens, but max_tokens is {params.max_tokens}",
                       param="migration")
    gen.request_id = migration.id or gen.request_id
    gen.created = migration.created if migration.created is not None else gen.created
    gen.resume_after(done, IncrementalDetokenizer(state.tokenizer, params).add(done))
    return msgspec.structs.replace(params, prompt_logprobs=None)  # they went out with the first chunk


def pull_hint(state: ServerState, body: Any) -> PullHint | None:
    """The router's `kv_pull`, for an instance that pulls (--enable-kv-pull); any other refuses it."""
    hint = getattr(body, "kv_pull", None)
    if hint is None:
        return None
    if not state.kv_pull:
        raise APIError("kv_pull names a peer to pull the prompt's prefix from; this instance was started without "
                       "--enable-kv-pull", param="kv_pull")
    return PullHint(hint.addr, hint.num_blocks)


def pd_params(body: Any) -> PDParams | None:
    pd = body.pd
    return None if pd is None else PDParams(pd.transfer_id, pd.role, pd.prefill_addr, pd.transport)


def sampling_params(state: ServerState, body: Any, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutput | None, **overrides: Any) -> Any:
    try:
        params = body.sampling_params(max_tokens, logprobs, state.sampling_defaults, structured)
        params = msgspec.structs.replace(params, **overrides) if overrides else params
        params.check_vocab(state.tokenizer.vocab_size)
        return params
    except ValueError as e:  # a combination the field checks cannot see (min_tokens > max_tokens, ...)
        raise APIError(str(e)) from None


