"""`pdserve launch`: a whole local deployment (router + prefill + decode [+ mixed] instances) from one command.

The deployment is data (a list of `InstanceSpec`); the start order is: router first (instances
register with it), then every instance at once. It is ready when the router's /health is 200 and
every instance is in its pool. A process that exits before then stops the deployment (a bad flag or
model is not transient). After that, `Supervisor` restarts any process that exits (router included)
on its own address and ports, while the router keeps serving on the others; one that crash-loops
stops the deployment, named. Ctrl-C or SIGTERM stops everything.

With the router on a loopback address, each instance gets its own (127.0.0.2, 127.0.0.3, ...), as
it would on its own host; `--separate-hosts` also gives each its own host id, so P and D talk tcp
as across machines. A fresh cluster secret is made for each deployment unless one is given.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.api.serve import DEMO_REQUEST, free_port
from pdserve.deploy.cluster_auth import ENV
from pdserve.deploy.supervisor import Supervisor
from pdserve.utils.dtype_names import gpu_present
from pdserve.utils.shm_room import free_host_memory
from pdserve.worker import core_loan


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--mixed", type=int, default=0, help="mixed (non-disaggregated) instances")
    p.add_argument("--host", default="127.0.0.1", help="where the router listens")
    p.add_argument("--port", type=int, default=8000, help="the router's port: the deployment's OpenAI endpoint")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every instance")
    p.add_argument("--routers", type=int, default=default_routers(),
                   help="router processes sharing --port (SO_REUSEPORT), each with its own port that instances "
                        "register at: one that dies refuses no connection and cuts only its own streams "
                        "(default: 2 with 2 or more cores)")
    p.add_argument("--cpu-binding", choices=["auto", "lend", "pin", "none"], default="auto",
                   help="on a CPU-only machine: pin gives each instance its own cores and as many torch threads; "
                        "lend (what auto does) also lets each decode instance compute on a prefill instance's "
                        "cores while that one has nothing to compute (pdserve/worker/core_loan.py); none lets "
                        "every instance use every core")
    p.add_argument("--separate-hosts", action="store_true",
                   help="give each instance its own host id, so prefill and decode use tcp as across machines")
    p.add_argument("--prefill-policy", default=None, help="the router's (see pdserve router --help)")
    p.add_argument("--decode-policy", default=None, help="the router's (see pdserve router --help)")
    p.add_argument("--pd-policy", default="conditional",
                   help="the router's: conditional (launch's default: short prompts are computed on the decode "
                        "instance) or always (see pdserve router --help)")
    p.add_argument("--max-local-prefill-length", default="512",
                   help="the router's (see pdserve router --help); launch's default 512 won on ShareGPT here")
    p.add_argument("--max-prefill-queue-tokens", default=None, help="the router's (see pdserve router --help)")
    p.add_argument("--local-prefill-decode-requests", default="4",
                   help="the router's (see pdserve router --help); launch's 4: a decode instance with few streams "
                        "borrows the prefill instance's core and computes a long prompt faster than P alone")
    p.add_argument("--migration-limit", default=None, help="the router's (see pdserve router --help)")
    p.add_argument("--api-key", default=None, help="clients of the router must send it as a Bearer token")
    p.add_argument("--splitwise-cache-buffer-size", type=float, default=0.0,
                   help="GB of host buffer each decode instance receives the prefill's KV into (decode only)")
    p.epilog = "Any other flag (e.g. --cache-transfer-protocol tcp, --kv-cache-memory 2G) goes to every instance."


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    role: str
    host: str
    port: int
    metrics_port: int
    pd_comm_port: int | None  # prefill and decode: fixed, so a restarted instance comes back where it was
    host_id: str | None = None  # None: the machine's own

    def command(self, router_url: str, extra: list[str]) -> list[str]:
        host_id = ["--host-id", self.host_id] if self.host_id else []
        pd_port = ["--pd-comm-port", str(self.pd_comm_port)] if self.pd_comm_port else []
        return [sys.executable, "-m", "pdserve.cli", "serve", "--splitwise-role", self.role, "--host", self.host,
                "--port", str(self.port), "--metrics-port", str(self.metrics_port), *pd_port,
                "--router", router_url, *host_id, *extra]


def default_routers() -> int:
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@dataclass(frozen=True)
class RouterSpec:
    name: str
    own_port: int | None  # None: the only router, on --port alone

    def flags(self) -> list[str]:
        return [] if self.own_port is None else ["--reuse-port", "--own-port", str(self.own_port)]


def plan_routers(host: str, n: int) -> list[RouterSpec]:
    if n < 1:
        raise ValueError("--routers must be at least 1")
    if n == 1:
        return [RouterSpec("router", None)]
    return [RouterSpec(f"router-{i}", free_port(host)) for i in range(n)]


def registration_urls(host: str, port: int, routers: list[RouterSpec]) -> list[str]:
    """Where instances register: every router's own port (the shared one reaches only one of them)."""
    return [f"http://{host}:{r.own_port if r.own_port is not None else port}" for r in routers]


def instance_hosts(router_host: str, n: int) -> list[str]:
    """Loopback: 127.0.0.2, 127.0.0.3, ... (one address per instance, as on separate hosts); else the router's."""
    if router_host in ("127.0.0.1", "localhost") and n <= 250:
        return [f"127.0.0.{2 + i}" for i in range(n)]
    return [router_host] * n


def plan(args: argparse.Namespace) -> list[InstanceSpec]:
    if (args.prefill > 0) != (args.decode > 0):
        raise ValueError("a PD deployment needs at least one --prefill and one --decode instance (or neither)")
    if args.prefill + args.decode + args.mixed == 0:
        raise ValueError("nothing to launch: give --prefill/--decode and/or --mixed")
    names = [(role, f"{role}-{i}") for role, count in (("prefill", args.prefill), ("decode", args.decode),
                                                         ("mixed", args.mixed)) for i in range(count)]
    hosts = instance_hosts(args.host, len(names))
    return [InstanceSpec(name, role, host, free_port(host), free_port(host),
                         free_port(host) if role != "mixed" else None,
                         f"launch-{host}" if args.separate_hosts else None)
            for (role, name), host in zip(names, hosts, strict=True)]


def split_cpus(n: int) -> list[set[int] | None]:
    """Cores for n instances: contiguous shares of this process's cores (one core each, shared round
    robin, when there are more instances than cores). Torch threads of co-located instances that all
    spin on every core slow each other down several-fold; pinned, each runs at its share's speed."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cores or n <= 1:
        return [None] * n
    if n >= len(cores):
        return [{cores[i % len(cores)]} for i in range(n)]
    per, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        size = per + (i < extra)
        out.append(set(cores[start:start + size]))
        start += size
    return out


def lend_cores(specs: list[InstanceSpec], cpu_sets: list[set[int] | None],
               flags_dir: Path) -> tuple[list[set[int] | None], list[dict[str, str]]]:
    """Pair the i-th prefill with the i-th decode instance: D may also run on P's cores, P raises a flag
    in flags_dir while it computes (pdserve/worker/core_loan.py). Unpaired instances keep their cores."""
    cpu_sets, envs = list(cpu_sets), [{} for _ in specs]
    prefills = [i for i, s in enumerate(specs) if s.role == "prefill"]
    decodes = [i for i, s in enumerate(specs) if s.role == "decode"]
    for p, d in zip(prefills, decodes, strict=False):
        own, lent = cpu_sets[d], cpu_sets[p]
        if not own or not lent or own & lent:
            continue
        flag = core_loan.create_flag(flags_dir / f"{specs[p].name}.flag")
        envs[p] = {core_loan.LEND_ENV: str(flag)}
        envs[d] = {core_loan.BORROW_ENV: core_loan.borrow_spec(flag, own, lent)}
        cpu_sets[d] = own | lent
    return cpu_sets, envs


def _cpu_only() -> bool:
    """Checked without importing torch, which would cost this supervising process ~200 MB for the
    deployment's whole life."""
    return not gpu_present()


SIZING_FLAGS = ("--kv-cache-memory", "--num-gpu-blocks-override")


def memory_shares(instance_args: list[str], n: int) -> list[str]:
    """On CPU, where no flag sizes the caches, each of the n instances gets an equal share of the free
    RAM as its --kv-cache-memory: started together, each would size from all of it, and together
    they could fill more than there is (an instance then dies of SIGBUS or the OOM killer)."""
    if not _cpu_only() or any(a.split("=")[0] in SIZING_FLAGS for a in instance_args):
        return []
    return ["--kv-cache-memory", str(free_host_memory() // n)]


def launch(args: argparse.Namespace) -> int:
    specs = plan(args)
    router_url = f"http://{args.host}:{args.port}"
    deployment = Supervisor({ENV: os.environ.get(ENV) or secrets.token_hex(16)})
    stop = threading.Event()
    stopped_by: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    flags_dir: Path | None = None
    try:
        router_flags = [f for flag, value in (("--prefill-policy", args.prefill_policy),
                                              ("--decode-policy", args.decode_policy), ("--pd-policy", args.pd_policy),
                                              ("--max-local-prefill-length", args.max_local_prefill_length),
                                              ("--max-prefill-queue-tokens", args.max_prefill_queue_tokens),
                                              ("--local-prefill-decode-requests",
                                               args.local_prefill_decode_requests),
                                              ("--migration-limit", args.migration_limit),
                                              ("--api-key", args.api_key))
                        if value for f in (flag, value)]
        routers = plan_routers(args.host, args.routers)
        for r in routers:
            deployment.start(r.name, [sys.executable, "-m", "pdserve.cli", "router", "--host", args.host,
                                      "--port", str(args.port), *r.flags(), *router_flags])
        registrations = registration_urls(args.host, args.port, routers)
        pinned = args.cpu_binding != "none" and _cpu_only()
        cpu_sets = split_cpus(len(specs)) if pinned else [None] * len(specs)
        envs: list[dict[str, str]] = [{} for _ in specs]
        shares = memory_shares(args.instance_args, len(specs))
        if shares:
            print(f"pdserve launch: no --kv-cache-memory given: each instance sizes its KV cache from "
                  f"{int(shares[1]) / 2**30:.1f} GiB (the free RAM / {len(specs)})", flush=True)
        if pinned and args.cpu_binding in ("auto", "lend"):
            flags_dir = Path(tempfile.mkdtemp(prefix="pdserve-cores-"))
            cpu_sets, envs = lend_cores(specs, cpu_sets, flags_dir)
        for spec, cpus, env in zip(specs, cpu_sets, envs, strict=True):
            cores = f", cores {','.join(map(str, sorted(cpus)))}" if cpus else ""
            print(f"pdserve launch: {spec.name} on {spec.host}:{spec.port}{cores}", flush=True)
            extra = [*shares, *args.instance_args]
            if spec.role == "decode" and args.splitwise_cache_buffer_size:
                extra += ["--splitwise-cache-buffer-size", str(args.splitwise_cache_buffer_size)]
            deployment.start(spec.name, spec.command(",".join(registrations), extra), cpus, env)
        error = _wait_ready(deployment, registrations, len(specs), args.ready_timeout, stop)
        if error:
            print(f"pdserve launch: {error}", file=sys.stderr, flush=True)
            return 1
        if stop.is_set():
            return _stopped(stopped_by)
        roles = ", ".join(f"{n} {r}" for r, n in (("prefill", args.prefill), ("decode", args.decode),
                                                    ("mixed", args.mixed)) if n)
        shared = f", {len(routers)} routers" if len(routers) > 1 else ""
        print(f"pdserve launch: ready on {router_url} ({roles}{shared}); Ctrl-C stops everything", flush=True)
        print(f"  curl {router_url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{DEMO_REQUEST}'", flush=True)
        while not stop.wait(0.5):
            if crash_loop := deployment.tend():
                print(f"pdserve launch: {crash_loop}", file=sys.stderr, flush=True)
                return 1
        return _stopped(stopped_by)
    finally:
        deployment.stop(grace=SIGINT_GRACE_S if stopped_by[:1] == [signal.SIGINT] else 0.0)
        if flags_dir is not None:
            shutil.rmtree(flags_dir, ignore_errors=True)


SIGINT_GRACE_S = 5.0  # after Ctrl-C, the deployment's processes (which got it too) stop on their own first


def _stopped(signals: list[int]) -> int:
    """The exit code of a deployment stopped by a signal (130 SIGINT, 143 SIGTERM), said once."""
    signum = signals[0] if signals else signal.SIGINT
    print(f"pdserve launch: stopped ({signal.Signals(signum).name}); stopping every process", file=sys.stderr,
          flush=True)
    return 128 + signum


def _wait_ready(deployment: Supervisor, router_urls: list[str], expected: int, timeout: float,
                stop: threading.Event) -> str | None:
    """Until every router has every instance in its pool and can serve."""
    deadline = time.monotonic() + timeout
    fewest = 0
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            if dead := deployment.dead():
                name, code = dead[0]
                return f"{name} exited (code {code}) before the deployment was ready (its output is above)"
            try:
                fewest = min(sum(i["healthy"] for i in client.get(f"{url}/registered").json()["instances"])
                             for url in router_urls)
                if fewest >= expected and all(client.get(f"{url}/health").status_code == 200 for url in router_urls):
                    return None
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                names = sorted(n for n in deployment.procs if not n.startswith("router"))
                return (f"not ready within {timeout:.0f} s: {fewest} of {expected} instances in the pool "
                        f"({', '.join(names)} were started)")
            stop.wait(0.5)
    return None


if os.name != "posix":  # pragma: no cover
    raise ImportError("pdserve launch needs a POSIX system")
