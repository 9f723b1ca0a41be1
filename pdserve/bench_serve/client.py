"""One streamed request as the benchmark sees it: client timestamps of every chunk, plus whatever
per-request timings the server sends (pdserve: `"collect_metrics": true`)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from pdserve.bench_serve.datasets import BenchRequest
from pdserve.http.errors import read_error


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    status: int | None = None  # the HTTP status (None: no answer); 429 is a refusal, not a failure
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # client clock (perf_counter), the moment the request was sent
    ttft: float | None = None  # seconds, client: send -> first token
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks that carried tokens
    e2el: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # offsets from start of the token chunks
    server: dict | None = None  # the server's per-request timings (last chunk's), when it sends them
    server_first: float | None = None  # the server's "arrival_time" (s since arrival) at the first token
    server_last: float | None = None  # ... and at the last
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache (usage), when it says
    text: str = ""  # the answer (a multi-turn user sends it back in its next turn)

    def as_dict(self) -> dict:
        return asdict(self)


def request_body(req: BenchRequest, backend: str, model: str | None, ignore_eos: bool,
                 temperature: float | None = None) -> dict:
    """The streamed request; no temperature unless given (vLLM's client sends none: the server's default)."""
    body: dict = {"max_tokens": req.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                  "collect_metrics": True}
    if temperature is not None:
        body["temperature"] = temperature
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if backend == "openai-chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send(client: httpx.AsyncClient, path: str, body: dict, prompt_len: int) -> RequestRecord:
    rec = RequestRecord(prompt_tokens=prompt_len, start=time.perf_counter())
    last = rec.start
    pieces: list[str] = []
    try:
        async with client.stream("POST", path, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {_message(text)}"
                rec.e2el = time.perf_counter() - rec.start  # how long a refusal (429) took
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = _message(json.dumps(data))
                    return rec
                now = time.perf_counter()
                if usage := data.get("usage"):
                    rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
                    rec.output_tokens = usage.get("completion_tokens") or rec.output_tokens
                    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if data.get("metrics"):
                    rec.server = data["metrics"]
                if not has_token(data):
                    continue
                pieces.append(_text(data["choices"][0]))
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                    rec.server_first = (data.get("metrics") or {}).get("arrival_time")
                else:
                    rec.itl.append(now - last)
                rec.server_last = (data.get("metrics") or {}).get("arrival_time", rec.server_last)
                rec.chunk_times.append(now - rec.start)
                last = now
        rec.e2el = time.perf_counter() - rec.start
        rec.text = "".join(pieces)
        if not rec.output_tokens:
            rec.output_tokens = len(rec.chunk_times)
        rec.ok = rec.ttft is not None
        if not rec.ok:
            rec.error = "the stream ended without a token"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def has_token(data: dict) -> bool:
    """vLLM's client rule: any chunk with a choice is a token chunk, its text empty or not (an answer
    that is a lone EOS has a TTFT and succeeds). The usage chunk has no choices."""
    return bool(data.get("choices"))


def _text(choice: dict) -> str:
    """A chunk's text: completions' `text`, chat's `delta.content`."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _message(text: str) -> str:
    error = read_error(text)
    return str(error.get("message")) if error is not None and "message" in error else text.strip()[:300]
