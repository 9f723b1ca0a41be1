"""vLLM's own benchmark client against pdserve: its `openai` and `openai-chat` backends, against the router of
a 1P1D `pdserve launch` and against a `pdserve serve`; prints completed / failed per run.

    .venv/bin/python bench/vllm_client_compat.py --vllm-python /path/to/venv/bin/python [--num-prompts 20]

The `openai-chat` backend sends chat content as a list of text parts, which pdserve once refused.
vLLM's client runs from its own venv (../shared/reference/anchors-cpu.md says how to install it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pd_sweep import wait_healthy

from pdserve.api.serve import free_port
from pdserve.loader import resolve_model_folder

CLIENT = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""
FLAGS = ["--num-gpu-blocks-override", "400", "--max-model-len", "2048"]


def vllm_bench(vllm_python: str, url: str, backend: str, num_prompts: int, result: Path) -> dict:
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    subprocess.run([vllm_python, "-c", CLIENT, "--backend", backend, "--base-url", url, "--endpoint", endpoint,
                    "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(resolve_model_folder(None)),
                    "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "16",
                    "--num-prompts", str(num_prompts), "--request-rate", "4", "--save-result",
                    "--result-dir", str(result.parent), "--result-filename", result.name, "--disable-tqdm"],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--num-prompts", type=int, default=20)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vllm-client-"))
    rows = []
    for name, command in (("router (launch 1P1D)", ["launch", "--prefill", "1", "--decode", "1", *FLAGS]),
                          ("pdserve serve", ["serve", *FLAGS])):
        port = free_port()
        log = open(tmp / f"{name.split()[0]}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *command, "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, name)
            for backend in ("openai", "openai-chat"):
                out = vllm_bench(args.vllm_python, url, backend, args.num_prompts, tmp / f"{port}-{backend}.json")
                rows.append((name, backend, out["completed"], args.num_prompts - out["completed"]))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    print("\n| server | vLLM client backend | completed | failed |\n|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {} |".format(*row))


if __name__ == "__main__":
    main()
