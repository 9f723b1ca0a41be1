"""`--dataset sharegpt-multiturn`: N users, each replaying one ShareGPT conversation turn by turn as a chat
client does: every turn sends the whole history, the model's own earlier answers included, then the user
thinks (an exponential pause, mean `--think-time`) before the next. Turns after the first are mostly a
prefix the cluster has computed, if they reach where it is cached; the report shows TTFT and the prefix
hit share (cached prompt tokens, as the server's usage reports them) by turn index.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from pdserve.bench_serve.client import RequestRecord, send
from pdserve.bench_serve.sharegpt import MAX_PROMPT_LEN, MAX_TOTAL_LEN, MIN_LEN, default_path, read_entries

PATH = "/v1/chat/completions"


@dataclass
class Conversation:
    user_turns: list[str]
    user_lens: list[int]  # their tokens
    output_lens: list[int]  # the dataset's reply lengths (tokens), or the fixed length


def sharegpt_conversations(path: Path | None, n: int, tokenizer, seed: int, max_turns: int,  # noqa: ANN001
                           output_len: int | None = None) -> list[Conversation]:
    """The first `n` conversations (vLLM's shuffle of the file) with two user turns or more; each cut to
    `max_turns` user turns and to vLLM's per-request limits (first prompt <= 1,024 tokens, a turn's text and
    reply <= 2,048 together, replies >= 4 tokens)."""
    entries = [e for e in read_entries(path or default_path()) if isinstance(e, dict)]
    random.Random(seed).shuffle(entries)
    out = []
    for entry in entries:
        if len(out) >= n:
            break
        conversation = _turns(entry.get("conversations") or [], tokenizer, max_turns, output_len)
        if conversation is not None:
            out.append(conversation)
    if not out:
        raise ValueError("no ShareGPT conversation has two user turns within the length rules")
    return out


def _turns(messages: list[dict], tokenizer, max_turns: int, output_len: int | None) -> Conversation | None:  # noqa: ANN001
    users, user_lens, lens = [], [], []
    for ask, reply in zip(messages[::2], messages[1::2], strict=False):
        if ask.get("from") != "human" or reply.get("from") != "gpt" or len(users) >= max_turns:
            break
        ask_len = len(tokenizer.encode(ask["value"]))
        reply_len = output_len or len(tokenizer.encode(reply["value"]))
        if ask_len < MIN_LEN or reply_len < MIN_LEN or ask_len + reply_len > MAX_TOTAL_LEN or \
                (not users and ask_len > MAX_PROMPT_LEN):
            break
        users.append(ask["value"])
        user_lens.append(ask_len)
        lens.append(reply_len)
    return Conversation(users, user_lens, lens) if len(users) >= 2 else None


@dataclass
class TurnRecord(RequestRecord):
    user: int = 0
    turn: int = 0  # 0: the conversation's first request


async def run_users(base: str, conversations: list[Conversation], model: str | None, think_time: float,
                    temperature: float | None, seed: int, max_context: int | None,
                    progress: bool = True, on_turn: Callable[[TurnRecord], None] | None = None,
                    ) -> tuple[list[TurnRecord], float]:
    """Every conversation at once, one user each; a user stops at its first failed turn, or before a turn
    whose history would pass `max_context` tokens (as the server counts them, from the last usage). `on_turn`
    hears of each turn as it completes."""
    total = sum(len(c.user_turns) for c in conversations)
    bar = tqdm(total=total, disable=not progress, desc="turns", file=sys.stderr)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        async def user(index: int, conversation: Conversation) -> list[TurnRecord]:
            rng = random.Random(seed * 1_000_003 + index)
            await asyncio.sleep(rng.uniform(0, think_time))  # users do not all start in the same instant
            records: list[TurnRecord] = []
            messages: list[dict] = []
            for turn, (text, out_len) in enumerate(zip(conversation.user_turns, conversation.output_lens,
                                                       strict=True)):
                if records and max_context and _next_len(records[-1], conversation, turn) > max_context:
                    break
                messages.append({"role": "user", "content": text})
                body = _body(messages, model, out_len, temperature)
                record = TurnRecord(**vars(await send(client, PATH, body, 0)), user=index, turn=turn)
                records.append(record)
                bar.update(1)
                if on_turn is not None:
                    on_turn(record)
                if not record.ok:
                    break
                messages.append({"role": "assistant", "content": record.text})
                await asyncio.sleep(rng.expovariate(1 / think_time) if think_time > 0 else 0)
            return records

        start = time.perf_counter()
        per_user = await asyncio.gather(*(user(i, c) for i, c in enumerate(conversations)))
        duration = time.perf_counter() - start
    bar.close()
    return [r for records in per_user for r in records], duration


def _next_len(last: RequestRecord, conversation: Conversation, turn: int) -> int:
    """Tokens of the next turn's prompt and answer: the last prompt and answer, the new text and its template."""
    return last.prompt_tokens + last.output_tokens + conversation.user_lens[turn] + 16 + conversation.output_lens[turn]


def _body(messages: list[dict], model: str | None, max_tokens: int, temperature: float | None) -> dict:
    body: dict = {"messages": list(messages), "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}, "collect_metrics": True}
    if model:
        body["model"] = model
    if temperature is not None:
        body["temperature"] = temperature
    return body


@dataclass
class TurnStats:
    turn: int
    requests: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def by_turn(records: list[TurnRecord]) -> list[TurnStats]:
    import numpy as np

    out = []
    for turn in sorted({r.turn for r in records}):
        ok = [r for r in records if r.turn == turn and r.ok]
        ttfts = [r.ttft * 1000 for r in ok]
        out.append(TurnStats(turn, len(ok), float(np.percentile(ttfts, 50)) if ttfts else None,
                             float(np.percentile(ttfts, 90)) if ttfts else None, sum(r.prompt_tokens for r in ok),
                             sum(r.cached_tokens or 0 for r in ok)))
    return out


def later_turns(records: list[TurnRecord]) -> TurnStats:
    """Every turn after the first, as one row (its `turn` is 1)."""
    rows = by_turn([r for r in records if r.turn >= 1])
    import numpy as np

    ttfts = [r.ttft * 1000 for r in records if r.turn >= 1 and r.ok]
    return TurnStats(1, sum(t.requests for t in rows), float(np.percentile(ttfts, 50)) if ttfts else None,
                     float(np.percentile(ttfts, 90)) if ttfts else None, sum(t.prompt_tokens for t in rows),
                     sum(t.cached_tokens for t in rows))


def format_turns(rows: list[TurnStats], later: TurnStats) -> str:
    lines = ["=" * 16 + " By turn " + "=" * 16, f"{'turn':>6}{'requests':>10}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}"
             f"{'prompt tok':>12}{'cached':>10}{'hit share':>11}"]
    for t in [*rows, later]:
        name = "2+" if t is later else str(t.turn + 1)
        p50 = f"{t.ttft_p50_ms:.1f}" if t.ttft_p50_ms is not None else "n/a"
        p90 = f"{t.ttft_p90_ms:.1f}" if t.ttft_p90_ms is not None else "n/a"
        lines.append(f"{name:>6}{t.requests:>10}{p50:>13}{p90:>13}{t.prompt_tokens:>12}{t.cached_tokens:>10}"
                     f"{t.hit_share:>11.1%}")
    return "\n".join(lines)


def plot_turns(path: Path, rows: list[TurnStats]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    turns = [t.turn + 1 for t in rows]
    left.plot(turns, [t.ttft_p50_ms or 0 for t in rows], marker="o", label="p50")
    left.plot(turns, [t.ttft_p90_ms or 0 for t in rows], marker="o", label="p90")
    left.set(xlabel="turn", ylabel="TTFT (ms)", title="TTFT by turn")
    left.legend()
    right.bar(turns, [t.hit_share * 100 for t in rows])
    right.set(xlabel="turn", ylabel="cached prompt tokens (%)", title="prefix hit share by turn", ylim=(0, 100))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
