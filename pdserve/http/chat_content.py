"""OpenAI chat message content as the chat template sees it.

The API allows `content` to be a string or a list of parts (`[{"type": "text", "text": "..."}]`), and
many clients (vLLM's `bench serve --backend openai-chat`, LangChain, ...) send parts. Text parts are
joined in order with newlines, as vLLM does for text-only models; any other part (image_url,
input_audio, ...) is refused with a message that names it, since the models served here read text.
"""

from __future__ import annotations

from typing import Any


def text_content(content: Any) -> Any:
    """A list of text parts as one string; a string or None unchanged; ValueError for other parts."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content part {i} has type {kind!r}: this server takes text parts only "
                             "({'type': 'text', 'text': ...})")
        texts.append(part["text"])
    return "\n".join(texts)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with list content joined into text (the router reads raw request bodies)."""
    return [{**m, "content": text_content(m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]
