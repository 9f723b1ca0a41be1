"""The router's reading of a request's prompt: token ids as the instances will see them.

With the model's tokenizer (the default), the ids are the ones the engine hashes into prefix-cache
blocks, so `cache_aware` matches the engine's own blocks and `least_tokens` counts real tokens.
Without one (`--tokenizer none`) the count is estimated from the text and cache_aware is refused.
A prompt the router cannot read is left for the instance to reject with its own 400.
"""

from __future__ import annotations

from pdserve.balancing.policies import RoutedRequest
from pdserve.http.chat_content import template_messages
from pdserve.tokenization.tokenizer import Tokenizer
from pdserve.tool_calling.prompt import render_messages, template_supports_tools

CHARS_PER_TOKEN = 4  # the estimate without a tokenizer


class PromptReader:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def read(self, path: str, body: dict) -> RoutedRequest:
        try:
            request = self._chat(body) if path.endswith("/chat/completions") else self._completion(body)
        except Exception:  # malformed: the instance answers it with a clear 400
            request = RoutedRequest(None, 0)
        request.single = scores_prompt(body)
        request.decodes = not request.single and not at_most_one_token(body)
        return request

    def _completion(self, body: dict) -> RoutedRequest:
        prompt = body.get("prompt_token_ids") or body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return RoutedRequest(list(prompt), len(prompt))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return RoutedRequest(None, len(prompt) // CHARS_PER_TOKEN + 1)
            ids = self.tokenizer.encode(prompt)
            return RoutedRequest(ids, len(ids))
        return RoutedRequest(None, 0)

    def _chat(self, body: dict) -> RoutedRequest:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return RoutedRequest(None, 0)
        messages = template_messages(messages)
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        if self.tokenizer is None:
            chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0 for m in messages)
            return RoutedRequest(None, chars // CHARS_PER_TOKEN + 1)
        # the instance's rendering (tools, tool-call histories), so the ids are the ones it hashes
        messages, extra = render_messages(messages, tools, template_supports_tools(self.tokenizer.chat_template))
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.get("add_generation_prompt", True), tokenize=True,
            continue_final_message=bool(body.get("continue_final_message")), **extra,
            **(body.get("chat_template_kwargs") or {}))
        return RoutedRequest(ids, len(ids))


def at_most_one_token(body: dict) -> bool:
    """max_tokens (or max_completion_tokens) 0 or 1: the answer is the prompt's step alone, no decoding."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return isinstance(limit, int) and not isinstance(limit, bool) and limit <= 1


def scores_prompt(body: dict) -> bool:
    """Echo with logprobs, or prompt_logprobs: the prompt's own logprobs are asked for."""
    return bool(body.get("echo")) and body.get("logprobs") is not None or body.get("prompt_logprobs") is not None
