"""The serving defaults that decide TTFT and inter-token latency, measured: one Poisson workload against a
`pdserve serve` instance per setting, all measured by `pdserve bench serve`, one table.

    .venv/bin/python bench/serve_tuning.py [--dataset sharegpt|random] [--rates 0.5,1,1.5] [--num-prompts 40]
        [--temperatures none,0] [--setting "NAME=FLAGS" ...] [--out bench-results/serve_tuning]

Default settings: the token budget per step (`--max-num-batched-tokens` 512, 1024, 2048 = the default,
4096) and the default with the worker's OpenMP threads bound to cores (OMP_PROC_BIND). A setting is
`NAME=FLAGS`, FLAGS given to `pdserve serve`, `ENV=VALUE` words among them set in its environment. Each
server first gets --warmup-prompts requests; each rate draws its own prompts (no prefix-cache hits
between runs). Ratios are against the first setting that carries the default flags ("budget 2048").
"""

from __future__ import annotations

import argparse
import shlex
import sys

from serve_vs_vllm import FLAGS, add_workload_args, measure, prepare, table

DEFAULT_SETTINGS = [
    "budget 512=--max-num-batched-tokens 512",
    "budget 1024=--max-num-batched-tokens 1024",
    "budget 2048=--max-num-batched-tokens 2048",
    "budget 4096=--max-num-batched-tokens 4096",
    "2048 + OMP bound=OMP_PROC_BIND=close OMP_PLACES=cores",
]
REFERENCE = "budget 2048"


def parse_setting(text: str) -> tuple[str, list[str], dict[str, str]]:
    name, _, rest = text.partition("=")
    words = shlex.split(rest)
    is_env = [("=" in w and not w.startswith("-")) for w in words]
    env = dict(w.split("=", 1) for w, e in zip(words, is_env, strict=True) if e)
    return name.strip(), [w for w, e in zip(words, is_env, strict=True) if not e], env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, "bench-results/serve_tuning")
    parser.add_argument("--setting", action="append", help="NAME=FLAGS; repeat; default: the budget sweep")
    args = parser.parse_args()
    prepare(args)
    settings = [parse_setting(s) for s in args.setting or DEFAULT_SETTINGS]
    pdserve = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "{port}", *FLAGS]
    results = {name: measure(name, [*pdserve, *flags], env, args) for name, flags, env in settings}
    if REFERENCE in results:  # the table's ratios are against its first row
        results = {REFERENCE: results.pop(REFERENCE), **results}
    text = table(results, args)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
