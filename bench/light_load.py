"""A harness's light load through `make demo`'s deployment, with admission by SLO on and off (issue 52).

    .venv/bin/python bench/light_load.py [--rounds 1] [--out bench-results/light_load.md]

What an eval harness or a script sends, answered as they would want it (every request, late or not), through
`pdserve launch --prefill 1 --decode 1 --kv-cache-memory 2G --max-model-len 4096` (make demo's flags) and a
2P2D fp32 deployment with --pd-policy always, each fresh for each setting:
- lm-eval's `local-completions` shape: 4 workers, 10 requests each, one after another: prompt scoring (echo +
  logprobs, max_tokens 1) and short greedy generations (32 tokens), alternating;
- a burst: 8 concurrent chats of 32 tokens, three times;
with --neighbour, a busy loop per core runs beside them (another job on the box).
The openai client with max_retries=0, so each 429 is counted. Prints, per setting, how many were answered,
refused (429) and failed otherwise, and the wall time of each load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
from pd_sweep import served

LAUNCH = [sys.executable, "-m", "pdserve.cli", "launch", "--port", "{port}", "--kv-cache-memory", "2G",
          "--max-model-len", "4096"]
DEPLOYMENTS = {"make demo 1P1D": ["--prefill", "1", "--decode", "1"],
               "2P2D fp32, pd-policy always": ["--prefill", "2", "--decode", "2", "--dtype", "float32",
                                               "--pd-policy", "always"]}
SETTINGS = {"admission on (2000 / 100 ms)": ["--ttft-slo-ms", "2000", "--tpot-slo-ms", "100"],
            "admission off": ["--ttft-slo-ms", "0", "--tpot-slo-ms", "0"]}
QUESTIONS = [
    "Question: What is the boiling point of water at sea level in degrees Celsius?\nAnswer:",
    "Question: Which planet is known as the Red Planet?\nAnswer:",
    "Question: Who wrote the play Romeo and Juliet?\nAnswer:",
    "Question: What gas do plants absorb from the air to make their food?\nAnswer:",
    "Question: How many continents are there on Earth?\nAnswer:",
]


def outcome(call) -> str:  # noqa: ANN001 (a callable)
    try:
        call()
        return "answered"
    except openai.RateLimitError:
        return "429"
    except openai.APIError as e:
        return f"failed: {e}"[:120]


def harness_worker(client: openai.OpenAI, model: str, worker: int) -> list[str]:
    results = []
    for i in range(10):
        prompt = QUESTIONS[(worker + i) % len(QUESTIONS)]
        if i % 2 == 0:
            results.append(outcome(lambda p=prompt: client.completions.create(
                model=model, prompt=p + " a liquid", max_tokens=1, echo=True, logprobs=1, temperature=0)))
        else:
            results.append(outcome(lambda p=prompt: client.completions.create(
                model=model, prompt=p, max_tokens=32, temperature=0)))
    return results


def burst(client: openai.OpenAI, model: str) -> list[str]:
    def chat(i: int) -> str:
        return outcome(lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell me a fact about the number {i}."}],
            max_tokens=32, temperature=0))

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(chat, range(8)))


@contextmanager
def neighbour(busy: bool) -> Iterator[None]:
    """A noisy neighbour on the box while the loads run: a busy loop per core (as another job would be)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] \
        if busy else []
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def measure(flags: list[str], log: Path, busy: bool) -> dict[str, tuple[list[str], float]]:
    """Each load once against a fresh deployment started with `flags` (the neighbour arrives once it is up)."""
    with served("launch", [*LAUNCH, *flags], {}, log) as url, neighbour(busy):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            harness = [r for rs in pool.map(lambda w: harness_worker(client, model, w), range(4)) for r in rs]
        out = {"harness: 4 workers x 10": (harness, time.perf_counter() - start)}
        start = time.perf_counter()
        bursts = [r for _ in range(3) for r in burst(client, model)]
        out["burst: 8 concurrent chats x 3"] = (bursts, time.perf_counter() - start)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="each setting this many times, taking turns")
    parser.add_argument("--out", type=Path, default=Path("bench-results/light_load.md"))
    parser.add_argument("--neighbour", action="store_true", help="a busy loop per core while the loads run")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["| deployment | setting | round | load | answered | 429 | other failures | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for round_ in range(args.rounds):
        for d, (deployment, shape) in enumerate(DEPLOYMENTS.items()):
            for i, (name, flags) in enumerate(SETTINGS.items()):
                log = args.out.with_suffix(f".{round_}.{d}{i}.log")  # one log per deployment and setting
                for load, (results, seconds) in measure([*shape, *flags], log, args.neighbour).items():
                    other = [r for r in results if r.startswith("failed")]
                    lines.append(f"| {deployment} | {name} | {round_ + 1} | {load} | {results.count('answered')} of "
                                 f"{len(results)} | {results.count('429')} | {len(other)} {other[:1] or ''} | "
                                 f"{seconds:.1f} |")
                    print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
