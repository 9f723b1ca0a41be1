"""Tool calls read back from the model's text, per model family (`--tool-call-parser`, vLLM's names).

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5/3, and
the fallback prompt of tool_calling/prompt.py). Text outside the blocks is the message content. Streaming
holds back text that may be the start of a block and hands out each call once its block is closed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pdserve.structured.tool_call_grammar import BLOCK_CLOSE, BLOCK_OPEN


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self, index: int | None = None) -> dict:
        out: dict = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class HermesParser:
    START, END = BLOCK_OPEN, BLOCK_CLOSE
    _BLOCK = re.compile(re.escape(BLOCK_OPEN) + r"\s*(.*?)\s*" + re.escape(BLOCK_CLOSE), re.DOTALL)

    def __init__(self) -> None:
        self._buffer = ""  # text not yet handed out: a possible block start, or an open block

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer -> (content, calls); content None when nothing but calls was written."""
        calls, content, last = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue
            content.append(text[last:m.start()])
            calls.append(call)
            last = m.end()
        if not calls:
            return text, []
        content.append(text[last:])
        rest = "".join(content).strip()
        return (rest or None), calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Streaming: (content to show now, calls completed by this delta)."""
        self._buffer += delta
        shown, calls = [], []
        while self._buffer:
            start = self._buffer.find(self.START)
            if start == -1:
                keep = _partial_suffix(self._buffer, self.START)
                shown.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            shown.append(self._buffer[:start])
            end = self._buffer.find(self.END, start)
            if end == -1:
                self._buffer = self._buffer[start:]
                break
            body = self._buffer[start + len(self.START):end]
            call = self._call(body.strip())
            if call is None:  # not a call after all: it is text
                shown.append(self._buffer[start:end + len(self.END)])
            else:
                calls.append(call)
            self._buffer = self._buffer[end + len(self.END):]
        return "".join(shown), calls

    def finish(self) -> str:
        """The end of the answer: what is still held back is text (an unclosed block)."""
        rest, self._buffer = self._buffer, ""
        return rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


PARSERS = {"hermes": HermesParser}
