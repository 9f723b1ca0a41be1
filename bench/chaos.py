"""Chaos: a 2P2D `pdserve launch` deployment under steady load while a random process is SIGKILLed
every few seconds; what the clients saw, how fast the deployment healed, and what leaked.

    .venv/bin/python bench/chaos.py [--duration 180] [--kill-every 20] [--clients 4] [--seed 0] [--resume]
                                    [--out bench-results/chaos.md] [-- extra flags for every instance]

Victims, drawn at random: an instance's server process, its engine, worker or cache service, or one
of the routers (`pdserve launch --routers`, 2 by default). Clients stream completions through the
router; a connection the router refuses (it is restarting) or a 5xx before any token is retried up
to 3 times with backoff, as the `openai` client does; the router itself retries a request on another
route when an instance fails before answering, and resumes a stream elsewhere when one fails after.
Reported: requests sent / succeeded / failed (and how many of those had started streaming), client
and router retries, latency percentiles, each kill with the time until the victim's instance (or the
router) served again, restarts, and at the end: KV blocks not given back, shared-memory segments and
IPC folders left.
Also: streams the routers migrated to another pair mid-answer (and how long each took), failures
that were streams cut by their own router's death, and the deployment's processes still running
after Ctrl-C.
With --resume, a client whose stream was cut after tokens sends the prompt with the text so far and asks for
the tokens still due (docs/resuming.md: the recipe, with continue_final_message on chat); such a request counts
as succeeded when its resumption does, and the report says how many were resumed.
Goals (issue 26): >= 99.5% succeed, every failure a stream cut by its own router's death, every
victim back within 15 s, nothing leaks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from pdserve.api.serve import free_port

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "The three primary colors are", "Once upon a time, in a small village,"]
VICTIMS = ("instance", "engine", "worker", "cache_service", "router")


@dataclass
class Outcome:
    start: float
    latency: float
    ok: bool
    streamed: bool  # a token had arrived before it failed
    client_retries: int
    error: str = ""
    resumed: int = 0  # times it was sent again with the text so far (--resume)


@dataclass
class Kill:
    at: float
    victim: str
    target: str  # instance url or "router"
    pid: int
    back_after: float | None = None


@dataclass
class Load:
    url: str
    max_tokens: int
    resume: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[Outcome] = field(default_factory=list)

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as http:
            while not self.stop.is_set():
                self.outcomes.append(self.one(http, rng.choice(PROMPTS)))

    def one(self, http: httpx.Client, prompt: str) -> Outcome:
        """One request, tried again (up to 3 times, 0.5 s then 1 s then 2 s apart) when the answer is a
        refused connection or a 5xx before any token: what the `openai` client does by default."""
        start = time.monotonic()
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        retries = resumed = 0
        while True:
            ok, streamed, error, retryable, text, tokens = self.attempt(http, body)
            if not ok and streamed and self.resume and resumed < 3 and tokens < body["max_tokens"]:
                resumed += 1  # the recipe of docs/resuming.md: the text so far becomes prompt
                body = {**body, "prompt": body["prompt"] + text, "max_tokens": body["max_tokens"] - tokens}
                continue
            if ok or not retryable or retries == 3:
                return Outcome(start, time.monotonic() - start, ok, streamed or resumed > 0, retries, error, resumed)
            time.sleep(0.5 * 2 ** retries)
            retries += 1

    def attempt(self, http: httpx.Client, body: dict) -> tuple[bool, bool, str, bool, str, int]:
        """(succeeded, a token had arrived, error, worth retrying, the text that arrived, its tokens)"""
        streamed, pieces, tokens = False, [], 0
        try:
            with http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return (False, False, f"{r.status_code} {r.text[:160]}",
                            r.status_code >= 500 or r.status_code == 429, "", 0)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return True, streamed, "", False, "".join(pieces), tokens
                    event = json.loads(line[6:])
                    if "error" in event:
                        return (False, streamed, f"error event: {event['error'].get('message', '')[:160]}", False,
                                "", 0)
                    streamed = True
                    pieces.extend(c.get("text", "") for c in event.get("choices", []))
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            return False, streamed, "the stream ended without [DONE]", False, "".join(pieces), tokens
        except httpx.ConnectError as e:  # nothing reached a server
            return False, False, repr(e), True, "", 0
        except httpx.HTTPError as e:
            return False, streamed, repr(e)[:160], not streamed, "".join(pieces), tokens


class Deployment:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "launch.log"
        self.tmp = tmp
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "launch", "--prefill", "2", "--decode", "2", "--port",
                 str(self.port), *args.instance_args], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True)
        deadline = time.monotonic() + 600
        while "ready on" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the deployment did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(1)

    def instances(self) -> list[dict]:
        try:
            return httpx.get(f"{self.url}/registered", timeout=3).json()["instances"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def routers(self) -> list[tuple[str, int]]:
        """(the router's own url, pid) of each router process (`pdserve launch --routers N`)."""
        out = []
        for p in psutil.Process(self.proc.pid).children():
            cmd = p.cmdline()
            if "router" in cmd[3:5]:
                own = cmd[cmd.index("--own-port") + 1] if "--own-port" in cmd else str(self.port)
                out.append((f"http://127.0.0.1:{own}", p.pid))
        return out

    def pick(self, victim: str, rng: random.Random) -> tuple[str, int] | None:
        if victim == "router":
            url, pid = rng.choice(self.routers())
            return f"router {url}", pid
        live = [i for i in self.instances() if i["healthy"]]
        if not live:
            return None
        inst = rng.choice(live)
        if victim == "instance":
            return inst["url"], inst["pid"]
        module = {"engine": "pdserve.engine", "worker": "pdserve.worker",
                  "cache_service": "pdserve.disagg.cache_service"}[victim]
        found = [p for p in psutil.Process(inst["pid"]).children(recursive=True) if module in p.cmdline()]
        return (inst["url"], found[0].pid) if found else None

    def serving_again(self, kill: Kill, pids_before: dict[str, int]) -> bool:
        """The victim's instance serves again as a new process (a router's restart count starts over
        when that router is restarted, so pids tell, not counts)."""
        if kill.target.startswith("router "):  # that router's own port: the others answer the shared one
            try:
                found = httpx.get(f"{kill.target.split()[1]}/registered", timeout=3).json()["instances"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return len([i for i in found if i["healthy"]]) == 4
        instances = self.instances()
        return any(i["url"] == kill.target and i["healthy"] and i["pid"] != pids_before.get(i["url"])
                   for i in instances)

    def leaked_blocks(self) -> dict[str, float]:
        out = {}
        for inst in self.instances():
            text = httpx.get(f"http://{inst['host']}:{inst['metrics_port']}/metrics", timeout=5).text
            values: dict[str, float] = collections.defaultdict(float)
            for line in text.splitlines():  # summed over the data-parallel ranks' series
                if line.startswith("pdserve_kv_cache_"):
                    values[line.split("{")[0].split()[0]] += float(line.rsplit(None, 1)[1])
            out[inst["url"]] = values["pdserve_kv_cache_total_blocks"] - values["pdserve_kv_cache_free_blocks"]
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return -9


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("pdserve-kv-*")}


def run(args: argparse.Namespace) -> str:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    segments_before = segments()
    dep = Deployment(args, tmp)
    print(f"deployment ready on {dep.url}; load and kills for {args.duration:.0f} s", flush=True)
    load = Load(dep.url, args.max_tokens, args.resume)
    threads = [threading.Thread(target=load.client, args=(args.seed + i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    kills: list[Kill] = []
    end = time.monotonic() + args.duration
    try:
        while time.monotonic() < end:
            time.sleep(args.kill_every)
            victim = rng.choice(VICTIMS)
            picked = dep.pick(victim, rng)
            if picked is None:
                continue
            pids = {i["url"]: i["pid"] for i in dep.instances()}
            kill = Kill(time.monotonic(), victim, *picked)
            psutil.Process(kill.pid).kill()
            kills.append(kill)
            print(f"  t={kill.at - end + args.duration:5.0f} s  SIGKILL {victim} of {kill.target} (pid {kill.pid})",
                  flush=True)
            while time.monotonic() < kill.at + 120 and not dep.serving_again(kill, pids):
                time.sleep(0.25)
            if dep.serving_again(kill, pids):
                kill.back_after = time.monotonic() - kill.at
    finally:
        load.stop.set()
        for t in threads:
            t.join(120)
    # Blocks held for a transfer whose peer died are freed when D's lease (--pd-transfer-timeout, 30 s)
    # runs out: a leak is what is still held after that.
    try:
        deadline = time.monotonic() + 45
        while any(dep.leaked_blocks().values()) and time.monotonic() < deadline:
            time.sleep(1)
        leaked = dep.leaked_blocks()
        restarts = {i["url"]: i["restarts"] for i in dep.instances()}
        launch_log = dep.log_path.read_text(errors="replace")
    finally:  # a failure above must not leave the deployment running
        code = dep.stop()
    time.sleep(5)
    left_segments = segments() - segments_before
    left_folders = [p.name for p in tmp.iterdir() if p.name.startswith("pdserve-")]
    left_processes = processes_of_session(dep.proc.pid)
    return report(args, load.outcomes, kills, leaked, restarts, launch_log, code, left_segments, left_folders,
                  left_processes)


def processes_of_session(sid: int) -> list[str]:
    """The deployment's processes still running (launch starts them all in its own session)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.info['cmdline'][1:4])}")
        except (ProcessLookupError, psutil.Error):
            pass
    return left


def migrations(launch_log: str) -> list[float]:
    """Seconds each resumed stream took to get going again, from the routers' log lines."""
    out = []
    for line in launch_log.splitlines():
        if "resumed a stream after" in line and " in " in line:
            try:
                out.append(float(line.rsplit(" in ", 1)[1].split()[0]))
            except ValueError:
                pass
    return out


def cut_by_a_router(outcome: Outcome, kills: list[Kill]) -> bool:
    """A stream that broke within a second of a router's death: that router was carrying it."""
    end = outcome.start + outcome.latency
    return outcome.streamed and any(k.target.startswith("router ") and abs(end - k.at) < 1.0 for k in kills)


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(args: argparse.Namespace, outcomes: list[Outcome], kills: list[Kill], leaked: dict[str, float],
           restarts: dict[str, int], launch_log: str, code: int, left_segments: set[str],
           left_folders: list[str], left_processes: list[str]) -> str:
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    lat = sorted(o.latency * 1000 for o in ok) or [0.0]
    router_retries = launch_log.count("retrying a request without")
    moved = migrations(launch_log)
    moved_text = (f"{len(moved)}, back streaming after p50 {statistics.median(moved):.2f} s / max {max(moved):.2f} s"
                  if moved else "0")
    by_router = sum(cut_by_a_router(o, kills) for o in failed)
    lines = [f"# Chaos: 2P2D, {args.duration:.0f} s, a SIGKILL every {args.kill_every:.0f} s, {args.clients} "
             f"streaming clients, {args.max_tokens} tokens each", "",
             "| requests | succeeded | failed | failed after streaming began | of those, cut by their router's "
             "death | client retries (refused connections) | router retries | streams migrated | success | "
             "latency p50 / p90 / p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| {len(outcomes)} | {len(ok)} | {len(failed)} | {sum(o.streamed for o in failed)} | {by_router} | "
             f"{sum(o.client_retries for o in outcomes)} | {router_retries} | {moved_text} | "
             f"{100 * len(ok) / max(1, len(outcomes)):.1f}% | {_pct(lat, 50):.0f} / {_pct(lat, 90):.0f} / "
             f"{_pct(lat, 99):.0f} |", "",
             f"clients {'resume' if args.resume else 'do not resume'} a cut stream (--resume): "
             f"{sum(o.resumed > 0 for o in outcomes)} requests resumed, "
             f"{sum(o.resumed > 0 and o.ok for o in outcomes)} of them completed", "",
             "| kill | victim | of | back in service after |", "|---|---|---|---|"]
    for i, k in enumerate(kills, 1):
        back = f"{k.back_after:.1f} s" if k.back_after is not None else "NOT BACK within 120 s"
        lines.append(f"| {i} | {k.victim} | {k.target} | {back} |")
    lines += ["", f"restarts seen by the router: {json.dumps(restarts)}; by launch: "
              f"{launch_log.count(' restarted (restart ')}",
              f"KV blocks still held 45 s after the load stopped (D's lease is 30 s): {json.dumps(leaked)}",
              f"after Ctrl-C (launch exit code {code}): shared-memory segments left {sorted(left_segments) or 'none'}, "
              f"IPC folders left {left_folders or 'none'}, processes left {left_processes or 'none'}"]
    if failed:
        kinds = collections.Counter(o.error[:90] for o in failed)
        lines += ["", "failures by kind:"] + [f"- {n} x {kind}" for kind, n in kinds.most_common(10)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180)
    parser.add_argument("--kill-every", type=float, default=20)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="clients resume a cut stream with the text so far")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here (markdown)")
    args, rest = parser.parse_known_args()
    args.instance_args = [a for a in rest if a != "--"] or ["--num-gpu-blocks-override", "300", "--max-model-len",
                                                           "1024"]
    text = run(args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
