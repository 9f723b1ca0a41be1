"""The prepared check for a session that is lent a GPU (issues 17, 28): under 5 minutes on one GPU.

    .venv/bin/python bench/gpu_check.py [--device cuda] [--vllm-python PATH] [--out DIR] [--only pd]

1. `pdserve serve` starts with its default configuration (mixed, prefix cache on: the startup row
   whose cache service used to die on a CUDA cache) and its startup log is kept;
2. greedy output of that server equals transformers on the same device and weights (fp32, the embedded
   model's oracle prompts; a difference counts only where transformers' top two were a near tie);
3. the profile run's figures (device memory, weights, peak, held elsewhere, KV cache) from the log;
4. bf16 throughput of pdserve (`bench/throughput.py`'s workload, smaller) and of vLLM when it is installed;
5. PD with the cache in device memory (issue 28): the staging copies in one process -- a copy issued
   while a slow kernel still writes the cache must see that kernel's result (the side stream waits for
   the compute stream), host -> device must be seen by the compute stream, and device -> staging
   bandwidth into the pinned segment against a plain pinned tensor (goal >= 80%) and a pageable one;
   then 1P1D on the one GPU in two processes (prefill and decode instance, KV over ipc through host
   staging) against a mixed instance: greedy output equal;
6. tensor and data parallel (issue 36), on a machine with two GPUs or more: the offline LLM at TP=2 (NCCL, one
   GPU per rank) on bench/parallel.py's model (8 heads, 2 KV heads) gives TP=1's greedy tokens (fp32), and its
   batch-1 decode TPOT beside TP=1's; `pdserve serve -dp 2` (one GPU per rank) answers alike from both ranks
   (/dp/0 and /dp/1); with one GPU each says SKIP;
7. a PASS/FAIL line per check and an exit code (0: all passed). `--only pd` runs 5 alone (~2 min), `--only tp` 6.

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
    from pdserve.tokenization.tokenizer import Tokenizer

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


def _bandwidth(copy, nbytes: int, device: str, repeat: int = 5) -> float:  # noqa: ANN001 - () -> event
    import torch

    copy()  # first touch
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        event = copy()
        if event is not None:
            event.synchronize()
    sync()
    return nbytes * repeat / (time.perf_counter() - start) / 1e9


def check_staging_copies(device: str) -> tuple[bool, str]:
    """The worker's KVCopier on a 180 MB bf16 cache of this model's geometry, without a server."""
    import torch

    from pdserve.kv.cache import KVCache
    from pdserve.kv.layout import KVLayout
    from pdserve.worker.kv_copier import KVCopier
    from pdserve.worker.protocol import DEVICE

    layout = KVLayout(512, 30, 16, 3, 64, "bfloat16")
    dev = KVCache.allocate(layout, device)
    staging, pageable = KVCache.create_shared(layout), KVCache.create_shared(layout)
    lines, ok = [], True
    try:
        pinned_copier = KVCopier(lambda: dev, {"staging": staging}, torch.device(device))
        pageable_copier = KVCopier(lambda: dev, {"staging": pageable}, torch.device(device), pin=False)
        blocks = list(range(layout.num_blocks))
        # ordering: the cache is written by a slow kernel the copy must wait for
        if device.startswith("cuda"):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the compute stream
        dev.tensor.fill_(7)
        pinned_copier.copy(DEVICE, "staging", blocks, blocks).synchronize()
        waited = bool((staging.tensor == 7).all())
        staging.tensor.fill_(3)
        event = pinned_copier.copy("staging", DEVICE, blocks, blocks)
        pinned_copier.device_waits(event)
        seen = bool((dev.tensor == 3).all())
        ok &= waited and seen
        lines.append(f"  device -> staging after a slow kernel saw its result: {waited}; "
                     f"staging -> device seen by the compute stream: {seen}")
        nbytes = layout.nbytes
        ref = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.startswith("cuda"))
        flat = dev.tensor.view(-1)
        def reference() -> None:
            ref.copy_(flat, non_blocking=True)

        ref_bw = _bandwidth(reference, nbytes, device)
        pin_bw = _bandwidth(lambda: pinned_copier.copy(DEVICE, "staging", blocks, blocks), nbytes, device)
        page_bw = _bandwidth(lambda: pageable_copier.copy(DEVICE, "staging", blocks, blocks), nbytes, device)
        runs = [b for b in blocks if b % 4 != 3]  # runs of 3 blocks, one layer at a time: P's per-layer copies
        layer_bytes = len(runs) * layout.layer_block_bytes * layout.num_layers

        def per_layer() -> None:
            for layer in range(layout.num_layers):
                pinned_copier.copy(DEVICE, "staging", runs, runs, layer)
            pinned_copier.synchronize()

        layer_bw = _bandwidth(per_layer, layer_bytes, device)
        share = pin_bw / ref_bw
        if device.startswith("cuda"):
            ok &= share >= 0.8
        lines.append(f"  device -> host GB/s: plain pinned tensor {ref_bw:.1f}, pinned staging {pin_bw:.1f} "
                     f"({share:.0%} of it; goal >= 80%), pageable staging {page_bw:.1f}, per-layer runs of 3 blocks "
                     f"into pinned staging {layer_bw:.1f}")
        pinned_copier.close()
        pageable_copier.close()
    finally:
        staging.close()
        pageable.close()
    return ok, "\n".join(lines)


def check_pd_on_one_device(device: str, out: Path) -> tuple[bool, str]:
    """Router + prefill + decode instance (two processes on the one GPU, KV over ipc through host staging)
    and a mixed instance; greedy token texts of PD must be the mixed instance's."""
    from pdserve.instance.startup import PRIVATE_CACHE_ENV
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    env = {**os.environ, **({} if device.startswith("cuda") else {PRIVATE_CACHE_ENV: "1"})}
    common = ["--device", device, "--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "256"]
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> subprocess.Popen:
        log = open(out / f"pd-{name}.log", "w")  # noqa: SIM115 - kept open for the child's lifetime
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        return proc

    try:
        start("router", ["router", "--port", str(router_port)])
        urls = {}
        for name, role in (("prefill", ["--splitwise-role", "prefill"]), ("decode", ["--splitwise-role", "decode"]),
                           ("mixed", [])):
            port = free_port()
            reg = ["--router", router_url, "--cache-transfer-protocol", "ipc"] if role else []
            (out / f"pd-{name}.jsonl").unlink(missing_ok=True)
            start(name, ["serve", "--port", str(port), *common, *role, *reg, "--startup-log",
                         str(out / f"pd-{name}.jsonl")])
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                up = all(httpx.get(f"{u}/health", timeout=2).status_code == 200 for u in urls.values())
                instances = httpx.get(f"{router_url}/registered", timeout=2).json()["instances"]
                pairs = sum(i["healthy"] for i in instances) >= 2  # P and D registered and health-checked
                if up and pairs and httpx.get(f"{router_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the PD deployment did not come up; see {out}/pd-*.log")
            time.sleep(1)
        tok = Tokenizer(resolve_model_folder(None))
        lines, ok = [], True
        for prompt in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
            got, want = served_greedy(router_url, ids), served_greedy(urls["mixed"], ids)
            same = got == want
            ok &= same
            lines.append(f"  {prompt[:40]!r}: PD {'equals' if same else 'DIFFERS FROM'} mixed ({len(got)} tokens)")
        plan = [json.loads(line) for line in (out / "pd-decode.jsonl").read_text().splitlines()][0]
        ok &= plan.get("device_cache") is True
        lines.append(f"  decode instance's startup row: device_cache={plan.get('device_cache')} steps={plan['steps']}")
        for name in ("prefill", "decode"):
            private = "KV cache created in device memory" in (out / f"pd-{name}.log").read_text(errors="replace")
            ok &= private
            lines.append(f"  {name} instance kept its cache in device memory: {private}")
        return ok, "\n".join(lines)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def throughput(vllm_python: str | None) -> tuple[bool, str]:
    # pdserve's default dtype and device (bf16 on CUDA); the workload of bench/throughput.py, halved
    cmd = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--skip-transformers", "--no-w8a8",
           "--requests", "32"]
    if vllm_python:
        cmd += ["--vllm-python", vllm_python]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    rows = [line for line in out.stdout.splitlines() if "tok/s" in line or " / " in line]
    return out.returncode == 0, "\n".join(f"  {r.strip()}" for r in rows) or out.stderr[-2000:]


def check_tensor_parallel(device: str) -> tuple[bool, str]:
    """TP=2 against TP=1 on the same GPUs: equal fp32 greedy tokens; decode TPOT of each."""
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        return True, f"  SKIP: {torch.cuda.device_count()} GPU(s); tensor parallel needs two"
    sys.path.insert(0, str(ROOT / "bench"))
    from parallel import bench_model

    from pdserve import LLM, SamplingParams

    folder = bench_model()
    prompts = [{"prompt_token_ids": [100 + 37 * i + j for j in range(24)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens, tpot = {}, {}
    for tp in (1, 2):
        with LLM(str(folder), tensor_parallel_size=tp, dtype="float32", device=device, max_model_len=1024) as llm:
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            m = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                             use_tqdm=False)[0].metrics
            tpot[tp] = (m.last_token_time - m.first_token_time) / 63 * 1000
    same = tokens[1] == tokens[2]
    return same, (f"  greedy tokens TP=2 {'equal' if same else 'DIFFER from'} TP=1; batch-1 decode TPOT "
                  f"TP=1 {tpot[1]:.2f} ms, TP=2 {tpot[2]:.2f} ms")


def check_data_parallel(device: str, out: Path) -> tuple[bool, str]:
    """`serve -dp 2`: each rank on its own GPU; the same greedy answers from rank 0 and rank 1."""
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        return True, f"  SKIP: {torch.cuda.device_count()} GPU(s); two data-parallel ranks need two"
    sys.path.insert(0, str(ROOT / "bench"))
    from parallel import bench_model

    port = free_port()
    with open(out / "serve-dp2.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--model",
                                 str(bench_model()), "--dtype", "float32", "-dp", "2", "--device", device,
                                 "--max-model-len", "1024"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            return False, f"  the server did not start (see {out / 'serve-dp2.log'})"
        prompts = [[100 + 37 * i + j for j in range(24)] for i in range(4)]
        answers = {r: [httpx.post(f"{url}/dp/{r}/v1/completions", timeout=120, json={
            "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
            for p in prompts] for r in (0, 1)}
        same = answers[0] == answers[1]
        return same, f"  rank 0 and rank 1 answers {'equal' if same else 'DIFFER'} (4 prompts, fp32 greedy)"
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "gpu_check"))
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--only", choices=["pd", "tp"], default=None,
                    help="run only the PD part (issue 28) or the tensor/data-parallel part (issue 36)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[tuple[str, bool, str]] = []
    start = time.monotonic()
    if args.only is None:
        results += mixed_checks(args, out)
    checks = (("staging copies (KVCopier: ordering, pinned bandwidth)", lambda: check_staging_copies(args.device)),
              ("1P1D on one device equals mixed (cache in device memory)",
               lambda: check_pd_on_one_device(args.device, out)),
              ("tensor parallel: TP=2 equals TP=1 (NCCL)", lambda: check_tensor_parallel(args.device)),
              ("data parallel: -dp 2, one GPU per rank", lambda: check_data_parallel(args.device, out)))
    checks = tuple(c for c in checks if args.only is None or ("parallel" in c[0]) == (args.only == "tp"))
    for name, check in checks:
        try:
            results.append((name, *check()))
        except Exception as e:  # noqa: BLE001 - a check that cannot run is a failed check, with its reason
            results.append((name, False, f"  {type(e).__name__}: {e}"))
    print(f"pdserve GPU check on {args.device} ({time.monotonic() - start:.0f} s); logs in {out}")
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}\n{detail}")
    passed = all(ok for _, ok, _ in results)
    print("ALL PASSED" if passed else "SOME CHECKS FAILED")
    return 0 if passed else 1


def mixed_checks(args: argparse.Namespace, out: Path) -> list[tuple[str, bool, str]]:
    """Issue 17's checks: the default server, greedy against transformers, throughput."""
    results: list[tuple[str, bool, str]] = []
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
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
