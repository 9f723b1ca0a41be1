"""OpenAI request bodies (pydantic, so bad input becomes a 400 naming the field).

Fields that do not change the answer (user, metadata, store, ...) are accepted and ignored; a known
OpenAI or vLLM field that would change it and is not implemented is refused with a 400 naming it
(`REFUSED`), never dropped. docs/api.md lists both.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdserve.http.chat_content import text_content
from pdserve.http.wire import KVPull, Migration, PDRequest
from pdserve.sampling import SamplingParams
from pdserve.structured.spec import StructuredOutput

# field -> why it is refused; a request may still send the field's neutral value (`NEUTRAL`)
REFUSED: dict[str, str] = {
    "best_of": "best_of is not supported; send n requests",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "suffix": "suffix (insertion) is not supported",
    "functions": "the deprecated `functions` is not supported; send `tools`",
    "function_call": "the deprecated `function_call` is not supported; send `tool_choice`",
    "audio": "audio output is not supported: this server serves text",
    "modalities": "only the text modality is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported: the served model does not reason",
    "verbosity": "verbosity is not supported",
    "bad_words": "bad_words is not supported; use logit_bias",
    "logits_processors": "custom logits processors are not supported",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "spaces_between_special_tokens": "spaces_between_special_tokens=false is not supported",
    "chat_template": "a per-request chat_template is not supported",
    "documents": "documents are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "return_token_ids": "return_token_ids is not supported",
    "kv_transfer_params": "kv_transfer_params is vLLM's connector API; pdserve's router pairs P and D",
    "vllm_xargs": "vllm_xargs is not supported",
}
NEUTRAL: dict[str, Any] = {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "modalities": ["text"],
                           "spaces_between_special_tokens": True,
                           "include_stop_str_in_output": False, "return_tokens_as_token_ids": False,
                           "return_token_ids": False}
# accepted and ignored: they do not change the answer
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id",
           "guided_decoding_backend", "cache_salt")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the running usage in every chunk (with include_usage)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` (exactly one of json, regex, choice, grammar, json_object)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None  # vLLM's; objects are closed unless this is false
    whitespace_pattern: str | None = None
    structural_tag: Any = None

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("structural_tag is not supported")
        return v


def _spec(kind: str, value: Any, flexible: bool, pattern: str | None, open_objects: bool = False) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        value = json.dumps(value)
    elif kind == "choice":
        value = json.dumps(list(value))
    return StructuredOutput(kind=kind, value=value, whitespace_flexible=flexible, whitespace_pattern=pattern,
                            open_objects=open_objects and kind == "json")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields (user, metadata, ...) are accepted and ignored

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    collect_metrics: bool = False  # pdserve: per-request server timestamps in the response
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower is served first
    pd: PDRequest | None = None  # pdserve: set by the router on requests to prefill/decode instances
    migration: Migration | None = None  # pdserve: set by the router on streams it can resume elsewhere
    kv_pull: KVPull | None = None  # pdserve: set by the router when a peer holds a longer prefix

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in REFUSED.items():
                value = data.get(name)
                if value not in (None, "", [], {}) and value != NEUTRAL.get(name, object()):
                    raise PydanticCustomError("refused_field", "{field}: {why}", {"field": name, "why": why})
        return data

    @model_validator(mode="after")
    def _allowed_ids_or_a_grammar(self) -> _SamplingFields:
        if self.allowed_token_ids and self.structured_spec() is not None:
            raise ValueError("allowed_token_ids cannot be combined with an output constraint: the grammar "
                             "decides which tokens may come")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None:
            for key, value in v.items():
                if not key.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys are token ids, got {key!r}")
                if not -100 <= value <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return v

    def constraint_field(self) -> str:
        """The field that carries the request's output constraint (for the `param` of its errors)."""
        names = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")
        return next((n for n in names if getattr(self, n, None) is not None), "response_format")

    def structured_spec(self) -> StructuredOutput | None:
        """The one output constraint this request asks for (ValueError if it asks for several)."""
        found: list[StructuredOutput] = []
        pattern = self.guided_whitespace_pattern
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(_spec("json_object", "", False, pattern))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format.json_schema.schema is required for type json_schema")
            found.append(_spec("json", rf.json_schema.json_schema, False, pattern, rf.json_schema.strict is False))
        so = self.structured_outputs
        if so is not None:
            flexible = so.disable_any_whitespace is False
            pattern = so.whitespace_pattern or pattern
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar)) if v is not None]
            if so.json_object:
                given.append(("json_object", ""))
            if len(given) != 1:
                raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object")
            found.append(_spec(*given[0], flexible, pattern, so.disable_additional_properties is False))
        for kind, value in (("json", self.guided_json), ("regex", self.guided_regex),
                            ("choice", self.guided_choice), ("grammar", self.guided_grammar)):
            if value is not None:
                found.append(_spec(kind, value, False, pattern))
        if len(found) > 1:
            raise ValueError("the request asks for more than one output constraint (response_format, "
                             "structured_outputs, guided_*): send one")
        return found[0] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """`defaults` (the model's generation_config) fill what the request leaves out."""
        d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **(defaults or {})}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return d[name] if value is None else value

        bias = {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None
        return SamplingParams(
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=bias, allowed_token_ids=self.allowed_token_ids, structured=structured,
            prompt_logprobs=self.prompt_logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_token_ids: list[int] | None = None  # pdserve: the prompt as token ids
    echo: bool = False  # before max_tokens: its check reads it
    add_special_tokens: bool = True  # the tokenizer's BOS (if it adds one) before a text prompt
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=20)
    continue_final_message: Literal[False] = False  # a chat field: a completion's prompt is already open

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_only_with_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("0 is allowed only with echo (scoring the prompt); at least 1 otherwise")
        return v


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: ToolFunction


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.function.get("name", ""))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        return text_content(content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message's content is left open and continued
    add_special_tokens: bool = False  # vLLM's: the template writes the special tokens itself
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: Literal[False] = False

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: send "
                             "add_generation_prompt false to continue the last message")
        if self.allowed_token_ids and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)):
            raise ValueError("allowed_token_ids cannot be combined with a forced tool_choice")
        choice = self.tool_choice
        if choice is not None and choice != "none" and choice != "auto" and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.name not in {t.function.name for t in self.tools or []}:
            raise ValueError(f"tool_choice names the function {choice.name!r}, which is not in tools")
        return self


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
