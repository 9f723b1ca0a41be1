"""A fresh server's first over-capacity burst, with admission by SLO and without (issue 52).

    .venv/bin/python bench/first_burst.py [--requests 64] [--prompt-words 450] [--rounds 1]
        [--shared-prefix WORDS] [--max-tokens 64] [--deployment serve|launch] [--out bench-results/first_burst.md]

    # issue 68's case: 48 chats on one ~250-word prefix (distinct ~20-word tails) against make demo's deployment
    .venv/bin/python bench/first_burst.py --deployment launch --requests 48 --shared-prefix 250 --prompt-words 20 \
        --max-tokens 32 --rounds 2 --out bench-results/first_burst_shared.md

The burst that matters most comes right after a deploy or a restart, before an engine has measured a step.
Each round starts `pdserve serve --kv-cache-memory 2G --max-model-len 4096` (or with --deployment launch, make
demo's 1P1D deployment: its router admits) afresh, with `--ttft-slo-ms 2000 --tpot-slo-ms 100` and without, and
sends it --requests streamed chats at once, each a distinct prompt of about 600 tokens (64 tokens each answer;
with --shared-prefix, every prompt begins with the same text of that many words: a burst the prefix cache serves),
with the openai client (no retries). Prints per setting: answered, refused (429) and failed requests, how many
got their first token within the 2 s objective, the admitted TTFT p50 / p90, how long the refusals took
(p50 / p99) and whether each carried Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import openai
from pd_sweep import served

COMMON = ["--port", "{port}", "--kv-cache-memory", "2G", "--max-model-len", "4096"]
DEPLOYMENTS = {"serve": [sys.executable, "-m", "pdserve.cli", "serve", *COMMON],
               "launch": [sys.executable, "-m", "pdserve.cli", "launch", "--prefill", "1", "--decode", "1", *COMMON]}
SETTINGS = {"admission 2000 / 100 ms": ["--ttft-slo-ms", "2000", "--tpot-slo-ms", "100"],
            "admission off": ["--ttft-slo-ms", "0", "--tpot-slo-ms", "0"]}
TTFT_SLO_S = 2.0
WORDS = ("harbour lantern orchard meadow river quarry granite willow ember falcon thistle copper saddle canyon "
         "marble pepper violet timber compass glacier").split()


def prompt(i: int, words: int, shared_words: int = 0) -> str:
    text = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))
    shared = " ".join(WORDS[(k * 11) % len(WORDS)] for k in range(shared_words))
    own = f"Request {i}: summarise these notes in one sentence. {text}"
    return f"Background for every request: {shared}\n\n{own}" if shared_words else own


async def one(client: openai.AsyncOpenAI, model: str, i: int, args: argparse.Namespace
              ) -> tuple[str, float, float | None, bool]:
    """(outcome, seconds to the answer's end or the refusal, TTFT, Retry-After given)."""
    start = time.perf_counter()
    ttft = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt(i, args.prompt_words, args.shared_prefix)}],
            max_tokens=args.max_tokens, stream=True, temperature=0)
        async for _ in stream:
            ttft = ttft or time.perf_counter() - start
        return "answered", time.perf_counter() - start, ttft, False
    except openai.RateLimitError as e:
        return "429", time.perf_counter() - start, None, e.response.headers.get("retry-after") is not None
    except openai.APIError:
        return "failed", time.perf_counter() - start, ttft, False


async def burst(url: str, args: argparse.Namespace) -> list[tuple[str, float, float | None, bool]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one(client, model, i, args) for i in range(args.requests)))
    finally:
        await client.close()


def pct(values: list[float], p: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(p * len(values)))]:.2f}"


def row(name: str, round_: int, results: list[tuple[str, float, float | None, bool]]) -> str:
    ttfts = [r[2] for r in results if r[0] == "answered" and r[2] is not None]
    refusals = [r[1] * 1000 for r in results if r[0] == "429"]
    within = sum(t <= TTFT_SLO_S for t in ttfts)
    retry = all(r[3] for r in results if r[0] == "429")
    return (f"| {name} | {round_} | {len(ttfts)} | {len(refusals)} | {sum(r[0] == 'failed' for r in results)} | "
            f"{within} | {pct(ttfts, 0.5)} / {pct(ttfts, 0.9)} | {pct(refusals, 0.5)} / {pct(refusals, 0.99)} | "
            f"{'yes' if refusals and retry else '-' if not refusals else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=450, help="about 600 tokens with the default model")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="WORDS",
                        help="every prompt begins with the same text of this many words (0: none)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--deployment", choices=sorted(DEPLOYMENTS), default="serve",
                        help="one server, or make demo's 1P1D deployment (its router admits)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/first_burst.md"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["| setting | round | answered | 429 | failed | first token within 2 s | admitted TTFT p50 / p90 s "
             "| refusal ms p50 / p99 | Retry-After |", "|---|---|---|---|---|---|---|---|---|"]
    for round_ in range(1, args.rounds + 1):
        for i, (name, flags) in enumerate(SETTINGS.items()):
            command = [*DEPLOYMENTS[args.deployment], *flags]
            with served(name, command, {}, args.out.with_suffix(f".{round_}.{i}.log")) as url:  # one log each
                lines.append(row(name, round_, asyncio.run(burst(url, args))))
            print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
