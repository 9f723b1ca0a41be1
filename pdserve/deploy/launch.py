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
from pathlib import Path

from pdserve.admission.predictor import SLO
from pdserve.api.serve import DEMO_REQUEST
from pdserve.config.flags import add_flags, from_args, to_flags
from pdserve.config.roles import Role
from pdserve.deploy.lifecycle import SIGINT_GRACE_S, stop_on_signals, stopped, wait_ready
from pdserve.deploy.plan import InstanceSpec, cpu_only, memory_shares, plan, plan_routers, registration_urls
from pdserve.deploy.settings import (
    PLANNER_FLAGS,
    ROUTER_DEFAULTS,
    ROUTER_FLAGS,
    LaunchSettings,
    default_routers,
    own_disk_folder,
    role_counts,
)
from pdserve.deploy.supervisor import Supervisor
from pdserve.planner.settings import PlannerSettings
from pdserve.router.settings import RouterSettings
from pdserve.utils.cluster_auth import ENV
from pdserve.worker import core_loan


def add_launch_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, LaunchSettings)
    routers = p.add_argument_group("router", "the router's flags (see pdserve router --help), given to every router")
    for name, remark in ROUTER_FLAGS.items():
        add_flags(routers, RouterSettings, only=[name], defaults=ROUTER_DEFAULTS, help_suffix=remark)
    planner = p.add_argument_group("planner", "with --planner: the planner's flags (see pdserve planner --help)")
    add_flags(planner, PlannerSettings, only=PLANNER_FLAGS)
    p.epilog = "Any other flag (e.g. --cache-transfer-protocol tcp, --kv-cache-memory 2G) goes to every instance."
















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










def launch_settings(args: argparse.Namespace) -> LaunchSettings:
    """The launch's settings from its flags (both launchers); with SLOs, instances calibrate before ready."""
    if SLO.from_ms(args.ttft_slo_ms, args.tpot_slo_ms).enabled:  # the routers judge from the instances' first report
        args.instance_args = [*args.instance_args, "--calibrate-load"]
    if args.planner and args.ray is not None:
        raise ValueError("--planner with --ray is not served yet (its instances' role changes are; the planner "
                         "process is not placed as a Ray actor): run `pdserve planner --router URL` beside it")
    if args.otlp_traces_endpoint:  # the routers' flag, and every instance's: one trace across the deployment
        args.instance_args = [*args.instance_args, "--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if args.planner:  # the planner changes roles in place, and sizes from the instances' calibration
        args.instance_args = [*args.instance_args, "--enable-role-switch", "--calibrate-load"]
    return from_args(LaunchSettings, args)


def planner_command(args: argparse.Namespace, registrations: list[str]) -> list[str]:
    settings = from_args(PlannerSettings, args, router=registrations)
    return [sys.executable, "-m", "pdserve.cli", "planner", *to_flags(settings)]


def launch(args: argparse.Namespace, settings: LaunchSettings) -> int:
    """A deployment on this machine (`--ray` runs deploy/ray_launch.py instead: the CLI chooses)."""
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
        pinned = settings.cpu_binding != "none" and cpu_only()
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
            extra = [*shares, *own_disk_folder(args.instance_args, spec.name)]
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
        if settings.planner:
            deployment.start("planner", planner_command(args, registrations))
        roles = ", ".join(f"{n} {r}" for r, n in role_counts(settings).items() if n)
        shared = f", {len(routers)} routers" if len(routers) > 1 else ""
        shared += ", the planner" if settings.planner else ""
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








def _dead(deployment: Supervisor) -> str | None:
    if dead := deployment.dead():
        name, code = dead[0]
        return f"{name} exited (code {code}) before the deployment was ready (its output is above)"
    return None




if os.name != "posix":  # pragma: no cover
    raise ImportError("pdserve launch needs a POSIX system")
