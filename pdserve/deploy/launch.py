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
import dataclasses
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.admission.predictor import SLO
from pdserve.api.serve import DEMO_REQUEST, free_port
from pdserve.config.flags import add_flags, from_args, to_flags
from pdserve.config.roles import Role
from pdserve.deploy.settings import (
    ROUTER_DEFAULTS,
    ROUTER_FLAGS,
    LaunchSettings,
    default_routers,
    instance_flag,
    role_counts,
    tensor_parallel_sizes,
)
from pdserve.deploy.supervisor import Supervisor
from pdserve.router.settings import RouterSettings
from pdserve.utils.cluster_auth import ENV
from pdserve.utils.dtype_names import gpu_present
from pdserve.utils.shm_room import free_host_memory
from pdserve.utils.stop_flag import StopFlag
from pdserve.worker import core_loan


def add_launch_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, LaunchSettings)
    routers = p.add_argument_group("router", "the router's flags (see pdserve router --help), given to every router")
    for name, remark in ROUTER_FLAGS.items():
        add_flags(routers, RouterSettings, only=[name], defaults=ROUTER_DEFAULTS, help_suffix=remark)
    p.epilog = "Any other flag (e.g. --cache-transfer-protocol tcp, --kv-cache-memory 2G) goes to every instance."


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    role: Role
    host: str
    port: int
    metrics_port: int
    pd_comm_port: int | None  # prefill and decode: fixed, so a restarted instance comes back where it was
    host_id: str | None = None  # None: the machine's own
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def endpoints(self) -> int:
        """What it registers with the router: each data-parallel rank in PD roles, itself when mixed."""
        return self.data_parallel_size if self.role != Role.MIXED else 1

    @property
    def cores_wanted(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def command(self, router_url: str, extra: list[str]) -> list[str]:
        host_id = ["--host-id", self.host_id] if self.host_id else []
        pd_port = ["--pd-comm-port", str(self.pd_comm_port)] if self.pd_comm_port else []
        return [sys.executable, "-m", "pdserve.cli", "serve", "--splitwise-role", self.role, "--host", self.host,
                "--port", str(self.port), "--metrics-port", str(self.metrics_port), *pd_port,
                "--router", router_url, *host_id, *extra, "--tensor-parallel-size", str(self.tensor_parallel_size)]


@dataclass(frozen=True)
class RouterSpec:
    name: str
    own_port: int | None  # None: the only router, on --port alone

    def command(self, settings: RouterSettings) -> list[str]:
        if self.own_port is not None:
            settings = dataclasses.replace(settings, reuse_port=True, own_port=self.own_port)
        return [sys.executable, "-m", "pdserve.cli", "router", *to_flags(settings)]


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


def instance_names(launch: LaunchSettings) -> list[tuple[Role, str]]:
    """(role, name) of every instance, in start order; a deployment that cannot serve is refused."""
    counts = role_counts(launch)
    if (counts[Role.PREFILL] > 0) != (counts[Role.DECODE] > 0):
        raise ValueError("a PD deployment needs at least one --prefill and one --decode instance (or neither)")
    if not sum(counts.values()):
        raise ValueError("nothing to launch: give --prefill/--decode and/or --mixed")
    return [(role, f"{role}-{i}") for role, count in counts.items() for i in range(count)]


def plan(launch: LaunchSettings, instance_args: list[str] = ()) -> list[InstanceSpec]:
    names = instance_names(launch)
    hosts = instance_hosts(launch.host, len(names))
    tp = tensor_parallel_sizes(launch, list(instance_args))
    dp = instance_flag(list(instance_args), ("--data-parallel-size", "-dp"), 1)
    return [InstanceSpec(name, role, host, free_port(host), free_port(host),
                         free_port(host) if role != Role.MIXED else None,
                         f"launch-{host}" if launch.separate_hosts else None, tp[role], dp)
            for (role, name), host in zip(names, hosts, strict=True)]


def split_cpus(weights: list[int]) -> list[set[int] | None]:
    """Cores for instances of these weights (their TP x DP sizes): contiguous shares of this process's cores in
    proportion (an instance's ranks split its share, worker/ranks.py); one core each, shared round robin,
    when there are no more cores than instances. Torch threads of co-located instances that all spin on
    every core slow each other down several-fold; pinned, each runs at its share's speed."""
    n = len(weights)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cores or n <= 1:
        return [None] * n
    if n >= len(cores):
        return [{cores[i % len(cores)]} for i in range(n)]
    total, out, start = sum(weights), [], 0
    for i, weight in enumerate(weights):
        left_for_others = n - i - 1
        size = max(1, min(round(len(cores) * weight / total), len(cores) - start - left_for_others))
        if i == n - 1:
            size = len(cores) - start
        out.append(set(cores[start:start + size]))
        start += size
    return out


def lend_cores(specs: list[InstanceSpec], cpu_sets: list[set[int] | None],
               flags_dir: Path) -> tuple[list[set[int] | None], list[dict[str, str]]]:
    """Pair the i-th prefill with the i-th decode instance: D may also run on P's cores, P raises a flag
    in flags_dir while it computes (pdserve/worker/core_loan.py). Unpaired instances keep their cores."""
    cpu_sets, envs = list(cpu_sets), [{} for _ in specs]
    prefills = [i for i, s in enumerate(specs) if s.role == Role.PREFILL]
    decodes = [i for i, s in enumerate(specs) if s.role == Role.DECODE]
    for p, d in zip(prefills, decodes, strict=False):
        own, lent = cpu_sets[d], cpu_sets[p]
        ranked = specs[p].cores_wanted > 1 or specs[d].cores_wanted > 1  # ranks pin their own cores
        if not own or not lent or own & lent or ranked:
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


def needs_memory_share(instance_args: list[str] | tuple[str, ...]) -> bool:
    """On CPU, with no flag that sizes the KV cache, instances started together must split the free RAM."""
    return _cpu_only() and not any(a.split("=")[0] in SIZING_FLAGS for a in instance_args)


def memory_shares(instance_args: list[str], n: int) -> list[str]:
    """On CPU, where no flag sizes the caches, each of the n instances gets an equal share of the free
    RAM as its --kv-cache-memory: started together, each would size from all of it, and together
    they could fill more than there is (an instance then dies of SIGBUS or the OOM killer)."""
    if not needs_memory_share(instance_args):
        return []
    return ["--kv-cache-memory", str(free_host_memory() // n)]


def launch(args: argparse.Namespace) -> int:
    settings = from_args(LaunchSettings, args)
    if SLO.from_ms(args.ttft_slo_ms, args.tpot_slo_ms).enabled:  # the routers judge from the instances' first report
        args.instance_args = [*args.instance_args, "--calibrate-load"]
    if settings.ray is not None:
        from pdserve.deploy.ray_launch import launch_on_ray

        return launch_on_ray(args, settings)
    if on_ray_only := [f for f in ("prefill_nodes", "decode_nodes", "router_nodes") if getattr(settings, f)]:
        print(f"pdserve launch: --{on_ray_only[0].replace('_', '-')} places instances on Ray nodes: it needs --ray",
              file=sys.stderr, flush=True)
        return 2
    router_settings = from_args(RouterSettings, args, host=settings.host, port=settings.port)
    specs = plan(settings, args.instance_args)
    router_url = f"http://{settings.host}:{settings.port}"
    deployment = Supervisor({ENV: os.environ.get(ENV) or secrets.token_hex(16)})
    stop, stopped_by = stop_on_signals()
    flags_dir: Path | None = None
    try:
        routers = plan_routers(settings.host, settings.routers or default_routers())
        router_settings = dataclasses.replace(router_settings, admitting_routers=len(routers))
        for r in routers:
            deployment.start(r.name, r.command(router_settings))
        registrations = registration_urls(settings.host, settings.port, routers)
        pinned = settings.cpu_binding != "none" and _cpu_only()
        cpu_sets = split_cpus([s.cores_wanted for s in specs]) if pinned else [None] * len(specs)
        envs: list[dict[str, str]] = [{} for _ in specs]
        shares = memory_shares(args.instance_args, len(specs))
        if shares:
            print(f"pdserve launch: no --kv-cache-memory given: each instance sizes its KV cache from "
                  f"{int(shares[1]) / 2**30:.1f} GiB (the free RAM / {len(specs)})", flush=True)
        if pinned and settings.cpu_binding in ("auto", "lend"):
            flags_dir = Path(tempfile.mkdtemp(prefix="pdserve-cores-"))
            cpu_sets, envs = lend_cores(specs, cpu_sets, flags_dir)
        for spec, cpus, env in zip(specs, cpu_sets, envs, strict=True):
            cores = f", cores {','.join(map(str, sorted(cpus)))}" if cpus else ""
            print(f"pdserve launch: {spec.name} on {spec.host}:{spec.port}{cores}", flush=True)
            extra = [*shares, *args.instance_args]
            if spec.role == Role.DECODE and settings.splitwise_cache_buffer_size:
                extra += ["--splitwise-cache-buffer-size", str(settings.splitwise_cache_buffer_size)]
            deployment.start(spec.name, spec.command(",".join(registrations), extra), cpus, env)
        error = wait_ready(lambda: _dead(deployment), registrations, sum(s.endpoints for s in specs),
                           settings.ready_timeout, stop, [s.name for s in specs])
        if error:
            print(f"pdserve launch: {error}", file=sys.stderr, flush=True)
            return 1
        if stop.is_set():
            return stopped(stopped_by)
        roles = ", ".join(f"{n} {r}" for r, n in role_counts(settings).items() if n)
        shared = f", {len(routers)} routers" if len(routers) > 1 else ""
        print(f"pdserve launch: ready on {router_url} ({roles}{shared}); Ctrl-C stops everything", flush=True)
        print(f"  curl {router_url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{DEMO_REQUEST}'", flush=True)
        while not stop.wait(0.5):
            if crash_loop := deployment.tend():
                print(f"pdserve launch: {crash_loop}", file=sys.stderr, flush=True)
                return 1
        return stopped(stopped_by)
    finally:
        deployment.stop(grace=SIGINT_GRACE_S if stopped_by[:1] == [signal.SIGINT] else 0.0)
        if flags_dir is not None:
            shutil.rmtree(flags_dir, ignore_errors=True)


def stop_on_signals() -> tuple[StopFlag, list[int]]:
    """SIGINT and SIGTERM set the flag (the deployment then stops in order); the list says which came."""
    stop = StopFlag()
    stopped_by: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, stopped_by


SIGINT_GRACE_S = 5.0  # after Ctrl-C, the deployment's processes (which got it too) stop on their own first


def stopped(signals: list[int]) -> int:
    """The exit code of a deployment stopped by a signal (130 SIGINT, 143 SIGTERM), said once."""
    signum = signals[0] if signals else signal.SIGINT
    print(f"pdserve launch: stopped ({signal.Signals(signum).name}); stopping every process", file=sys.stderr,
          flush=True)
    return 128 + signum


def _dead(deployment: Supervisor) -> str | None:
    if dead := deployment.dead():
        name, code = dead[0]
        return f"{name} exited (code {code}) before the deployment was ready (its output is above)"
    return None


def wait_ready(failure: Callable[[], str | None], router_urls: list[str], expected: int, timeout: float,
               stop: StopFlag, names: list[str]) -> str | None:
    """Until every router has every instance in its pool and can serve; what went wrong, if something did
    (`failure`: a member that failed while starting)."""
    deadline = time.monotonic() + timeout
    fewest = 0
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            if error := failure():
                return error
            try:
                fewest = min(sum(i["healthy"] for i in client.get(f"{url}/registered").json()["instances"])
                             for url in router_urls)
                if fewest >= expected and all(client.get(f"{url}/health").status_code == 200 for url in router_urls):
                    return None
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                return (f"not ready within {timeout:.0f} s: {fewest} of {expected} instances in the pool "
                        f"({', '.join(names)} were started)")
            stop.wait(0.5)
    return None


if os.name != "posix":  # pragma: no cover
    raise ImportError("pdserve launch needs a POSIX system")
