"""What a prefix pull from a holder that dies does to the puller's other streams, in one run.

    .venv/bin/python bench/pull_stall.py [--streams 4] [--prompt-tokens 800] [--repeats 3]

Three instances on this machine (`pdserve serve --swap-space 0.2 --enable-kv-pull`; the holder and a bystander at
nice 10, standing for other hosts): the holder computes a prompt (its blocks go to its host tier); the puller serves
`--streams` long streamed answers. Three times per repeat:
  - without: the puller is sent a prompt of the same length without a hint (it computes it) while the streams run;
  - a peer killed: the same, and the bystander is SIGKILLed a second later (what a dying neighbour costs on two
    cores by itself);
  - dead holder: the holder's cache service is stopped (SIGSTOP: it takes the pull and never answers), the puller is
    sent the prompt with the hint naming the holder, and the holder is SIGKILLed a second later; the puller waits
    out the pull's deadline, then computes.
For each, the inter-token latencies of the other streams over `--window` seconds from the prompt's arrival (each
window holds the prompt's one prefill): p50, p99 and the largest gap, and the last case's p99 over the others'.
(Until the pull ran off the step, the whole engine stopped for the pull's 2-3 s deadline.)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from pd_sweep import wait_healthy  # noqa: E402
from step_profile import machine  # noqa: E402

from pdserve.api.serve import free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ["--swap-space", "0.2", "--enable-kv-pull", "--max-model-len", "4096", "--kv-cache-memory", "1G"]


class Instance:
    def __init__(self, name: str, folder: Path, nice: int = 0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-m", "pdserve.cli", "serve",
                                          "--port", str(self.port), *FLAGS], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_healthy(self.url, self.proc, name)

    def block_server(self) -> str:
        match = re.search(r"serving host-tier blocks on port (\d+)", self.log_path.read_text())
        if not match:
            raise SystemExit(f"no block server in {self.log_path}")
        return f"127.0.0.1:{match.group(1)}"

    def cache_service(self) -> psutil.Process:
        return next(p for p in psutil.Process(self.proc.pid).children(recursive=True)
                    if "pdserve.disagg.cache_service" in " ".join(p.cmdline()))

    def kill(self) -> None:
        for p in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]:
            p.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)


def complete(url: str, prompt: list[int], hint: dict | None = None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if hint:
        body["kv_pull"] = hint
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()


def stream_times(url: str, stop: threading.Event, out: list[float]) -> None:
    """Streams one long answer after another until `stop`, appending each token's arrival (monotonic)."""
    while not stop.is_set():
        body = {"model": MODEL, "prompt": "Count slowly: 1, 2, 3,", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out.append(time.monotonic())
                if stop.is_set():
                    break


def gaps_during(streams: list[list[float]], start: float, end: float) -> list[float]:
    return [b - a for times in streams for a, b in zip(times, times[1:], strict=False) if start <= b <= end]


def measure(puller: Instance, streams: int, during, window: float) -> tuple[list[float], float]:  # noqa: ANN001
    """Run `during()` while `streams` streams run on the puller; the streams' gaps over `window` seconds from its
    start (the same length for both cases, each holding one prompt's prefill), and how long `during()` took."""
    stop, times = threading.Event(), [[] for _ in range(streams)]
    threads = [threading.Thread(target=stream_times, args=(puller.url, stop, t)) for t in times]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the streams are decoding
    start = time.monotonic()
    during()
    took = time.monotonic() - start
    time.sleep(max(0.0, start + window - time.monotonic()))
    stop.set()
    for t in threads:
        t.join()
    return gaps_during(times, start, start + window), took


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_repeat(folder: Path, rep: int, args: argparse.Namespace) -> tuple[list[float], ...]:
    """The streams' gaps: without, a peer killed (no pull), the holder killed mid-pull."""
    prompt = [1000 + (rep * 7919 + i * 31) % 40000 for i in range(args.prompt_tokens)]
    # The holder stands for another host (nice 10); still, on these two cores its death (four processes torn down)
    # takes the CPU from the puller's streams for ~100 ms, which the middle case measures alone.
    holder, puller = Instance("holder", folder, nice=10), Instance("puller", folder)
    bystander = Instance("bystander", folder, nice=10)
    try:
        complete(holder.url, prompt)
        time.sleep(1.0)  # its blocks reach the holder's host tier when freed
        computed, _ = measure(puller, args.streams, lambda: complete(puller.url, prompt[::-1]), args.window)

        def peer_killed() -> None:
            killer = threading.Timer(1.0, bystander.kill)
            killer.start()
            complete(puller.url, prompt[1:])  # computed
            killer.join()

        killed, _ = measure(puller, args.streams, peer_killed, args.window)
        hint = {"addr": holder.block_server(), "num_blocks": args.prompt_tokens // 64}

        def dead_holder() -> None:
            holder.cache_service().send_signal(signal.SIGSTOP)
            killer = threading.Timer(1.0, holder.kill)
            killer.start()
            complete(puller.url, prompt, hint)
            killer.join()

        pulled, _ = measure(puller, args.streams, dead_holder, args.window)
    finally:
        for instance in (puller, holder, bystander):
            instance.stop()
    return computed, killed, pulled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=float, default=5.0, help="seconds of the streams' tokens compared, from the "
                    "prompt's arrival (longer than the dead holder's wait)")
    args = ap.parse_args()
    print(f"Machine: {machine()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            rows.append(one_repeat(Path(tmp), rep, args))
            print("  repeat " + str(rep) + ": p99 " + " / ".join(f"{pct(g, 0.99) * 1e3:.0f}" for g in rows[-1])
                  + " ms (without / a peer killed / the holder killed mid-pull)", flush=True)
    print(f"\n{args.streams} streams' inter-token latency over {args.window:g} s from the prompt's arrival, "
          "p50 / p99 / max ms\n")
    print("| repeat | without | a peer killed, no pull | holder killed mid-pull | p99 ratio to without / to peer "
          "killed |")
    print("|---|---|---|---|---|")
    for i, (a, b, c) in enumerate(rows):
        cells = [f"{statistics.median(g) * 1e3:.0f} / {pct(g, 0.99) * 1e3:.0f} / {max(g) * 1e3:.0f}" for g in (a, b, c)]
        print(f"| {i} | {' | '.join(cells)} | {pct(c, 0.99) / pct(a, 0.99):.2f} / {pct(c, 0.99) / pct(b, 0.99):.2f} |")


if __name__ == "__main__":
    main()
