"""OpenAI request bodies (pydantic, so bad input becomes a 400 naming the field)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.http.chat_content import text_content
from pdserve.http.wire import PDRequest
from pdserve.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, ...) are accepted and ignored

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
    collect_metrics: bool = False  # pdserve: per-request server timestamps in the response
    pd: PDRequest | None = None  # pdserve: set by the router on requests to prefill/decode instances

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults` (the model's generation_config) fill what the request leaves out."""
        d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **(defaults or {})}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return d[name] if value is None else value

        return SamplingParams(
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_token_ids: list[int] | None = None  # pdserve: the prompt as token ids
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

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
    chat_template_kwargs: dict[str, Any] | None = None
