"""The prepared check for a session that is lent a GPU (issue 17): under 5 minutes on one GPU.

    .venv/bin/python bench/gpu_check.py [--device cuda] [--vllm-python PATH] [--out DIR]

1. `pdserve serve` starts with its default configuration (mixed, prefix cache on: the startup row
   whose cache service used to die on a CUDA cache) and its startup log is kept;
2. greedy output of that server equals transformers on the same device and weights (fp32, the embedded
   model's oracle prompts; a difference counts only where transformers' top two were a near tie);
3. the profile run's figures (device memory, weights, peak, held elsewhere, KV cache) from the log;
4. bf16 throughput of pdserve (`bench/throughput.py`'s workload, smaller) and of vLLM when it is installed;
5. a PASS/FAIL line per check and an exit code (0: all passed).

`--device cpu` runs the same script on a CPU machine (a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "Explain in a few sentences why the sky is blue.",
           "Write a short poem about the ocean."]
NEW_TOKENS = 24
NEAR_TIE = 0.02


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(device: str, dtype: str, out: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    (out / f"startup-{dtype}.jsonl").unlink(missing_ok=True)
    log = open(out / f"serve-{dtype}.log", "w")  # noqa: SIM115 - kept open for the child's lifetime
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--device", device,
                             "--dtype", dtype, "--max-model-len", "1024", "--startup-log",
                             str(out / f"startup-{dtype}.jsonl")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with code {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"pdserve serve was not healthy within 180 s; see {log.name}")


def served_greedy(url: str, prompt_ids: list[int]) -> list[str]:
    """The server's greedy tokens, as the token texts its logprobs carry (Tokenizer.token_text)."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt_ids, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["tokens"]


def check_greedy(url: str, device: str) -> tuple[bool, str]:
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.loader import resolve_model_folder
    from pdserve.loader.default_model import default_model_path
    from pdserve.tokenizer import Tokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = model.to(device).eval()
    tok = Tokenizer(resolve_model_folder(None))
    lines, ok = [], True
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        with torch.no_grad():
            x = torch.tensor([ids], device=device)
            gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tok.eos_token_ids[0])
        want = [tok.token_text(t) for t in gen.sequences[0, len(ids):].tolist()]
        got = served_greedy(url, ids)
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        if same is None:
            lines.append(f"  {prompt[:40]!r}: {len(want)} tokens equal")
            continue
        logits = gen.logits[same][0].float()
        logits[list(tok.eos_token_ids)] = float("-inf")  # min_new_tokens / min_tokens keep EOS out on both sides
        top2 = logits.topk(2).values
        margin = float(top2[0] - top2[1])
        tie = margin < NEAR_TIE
        ok &= tie
        lines.append(f"  {prompt[:40]!r}: equal up to token {same}, where transformers' top two differ by "
                     f"{margin:.4f} ({'a near tie' if tie else 'NOT a near tie'})")
    return ok, "\n".join(lines)


def startup_figures(out: Path, dtype: str) -> tuple[bool, str]:
    events = [json.loads(line) for line in (out / f"startup-{dtype}.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    text = f"  startup events: {', '.join(kinds)}"
    log = (out / f"serve-{dtype}.log").read_text(errors="replace")
    profile = re.findall(r"profile run: .*", log)
    text += "\n  " + (profile[-1] if profile else "no profile-run line in the log")
    return kinds[-1:] == ["ready"], text


def throughput(vllm_python: str | None) -> tuple[bool, str]:
    # pdserve's default dtype and device (bf16 on CUDA); the workload of bench/throughput.py, halved
    cmd = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--skip-transformers", "--no-w8a8",
           "--requests", "32"]
    if vllm_python:
        cmd += ["--vllm-python", vllm_python]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    rows = [line for line in out.stdout.splitlines() if "tok/s" in line or " / " in line]
    return out.returncode == 0, "\n".join(f"  {r.strip()}" for r in rows) or out.stderr[-2000:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "gpu_check"))
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[tuple[str, bool, str]] = []
    start = time.monotonic()
    proc = None
    try:
        proc, url = start_server(args.device, "float32", out)
        results.append(("default server starts (mixed, prefix cache)", *startup_figures(out, "float32")))
        results.append(("greedy equals transformers (fp32)", *check_greedy(url, args.device)))
    except Exception as e:  # noqa: BLE001 - a check that cannot run is a failed check, with its reason
        results.append(("default server starts (mixed, prefix cache)", False, f"  {e}"))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if not args.skip_throughput:
        try:
            results.append(("throughput (pdserve default dtype, vLLM if installed)",
                            *throughput(args.vllm_python)))
        except Exception as e:  # noqa: BLE001
            results.append(("throughput", False, f"  {e}"))
    print(f"pdserve GPU check on {args.device} ({time.monotonic() - start:.0f} s); logs in {out}")
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}\n{detail}")
    passed = all(ok for _, ok, _ in results)
    print("ALL PASSED" if passed else "SOME CHECKS FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
