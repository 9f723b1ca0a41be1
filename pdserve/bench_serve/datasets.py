"""Benchmark prompts: `random` (exact token lengths from the model's own tokenizer) or a JSON-lines file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchRequest:
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat
    prompt_len: int  # tokens, when known (0: unknown)
    max_tokens: int


def random_requests(tokenizer, n: int, input_len: int, output_len: int, range_ratio: float,  # noqa: ANN001
                    seed: int) -> list[BenchRequest]:
    """Token-id prompts of exact lengths in [len*(1-r), len*(1+r)], drawn from the ordinary vocabulary."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "special_token_ids", ()) or ()) | set(tokenizer.eos_token_ids)
    vocab = [t for t in range(min(tokenizer.vocab_size, 49152)) if t not in special][256:]  # skip byte tokens
    out = []
    for _ in range(n):
        lo, hi = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
        olo, ohi = max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio)))
        length = rng.randint(lo, hi)
        out.append(BenchRequest([rng.choice(vocab) for _ in range(length)], None, length, rng.randint(olo, ohi)))
    return out


def jsonl_requests(path: Path, n: int, default_output_len: int, seed: int, tokenizer=None) -> list[BenchRequest]:  # noqa: ANN001
    """One JSON object per line: {"messages": [...]} (chat) or {"prompt": "..."}; optional "max_tokens"."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not ("messages" in obj or "prompt" in obj):
                raise ValueError(f"{path}:{number}: each line needs \"messages\" or \"prompt\"")
            rows.append(obj)
    if not rows:
        raise ValueError(f"{path} holds no requests")
    rng = random.Random(seed)
    rng.shuffle(rows)
    out = []
    for i in range(n):
        obj = rows[i % len(rows)]
        max_tokens = int(obj.get("max_tokens", default_output_len))
        if "messages" in obj:
            length = len(tokenizer.apply_chat_template(obj["messages"], tokenize=True)) if tokenizer else 0
            out.append(BenchRequest(None, obj["messages"], length, max_tokens))
        else:
            length = len(tokenizer.encode(obj["prompt"])) if tokenizer else 0
            out.append(BenchRequest(obj["prompt"], None, length, max_tokens))
    return out
