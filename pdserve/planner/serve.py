"""`pdserve planner`: the loop as a process of the deployment (alone, or started by `pdserve launch --planner`),
and `pdserve planner profile`: an instance's calibration saved as the deployment's profile."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from pathlib import Path

import httpx

from pdserve.config.flags import add_flags, from_args
from pdserve.planner.loop import Planner
from pdserve.planner.metrics import PlannerMetrics
from pdserve.planner.profile import fetch_profile
from pdserve.planner.settings import PlannerSettings
from pdserve.planner.sizing import DeploymentProfile
from pdserve.utils.cluster_auth import ENV
from pdserve.utils.process import die_with_parent, exit_on_sigterm

log = logging.getLogger("pdserve.planner")


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, PlannerSettings)
    sub = parser.add_subparsers(dest="planner_command")
    profile = sub.add_parser("profile", help="save an instance's load calibration (--calibrate-load) as the "
                             "deployment's profile, for --planner-profile")
    profile.add_argument("--url", required=True, help="the instance, e.g. http://127.0.0.1:8001")
    profile.add_argument("--output", type=Path, default=Path("planner-profile.json"))


def planner_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.planner_command == "profile":
        return asyncio.run(_save_profile(args.url, args.output))
    exit_on_sigterm()
    if "PDSERVE_PARENT_PID" in os.environ:  # started by `pdserve launch`: do not outlive it
        die_with_parent()
    settings = from_args(PlannerSettings, args)
    settings.check()
    if settings.cluster_secret:
        os.environ[ENV] = settings.cluster_secret
    profile = DeploymentProfile.load(settings.planner_profile) if settings.planner_profile else None
    metrics = PlannerMetrics()
    from prometheus_client import start_http_server

    port = settings.planner_metrics_port or _free_port()
    start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    print(f"pdserve planner: watching {', '.join(settings.router)} every {settings.planner_interval:g} s "
          f"(TTFT SLO {settings.planner_ttft_slo_ms:g} ms, TPOT SLO {settings.planner_tpot_slo_ms:g} ms; metrics on "
          f"http://127.0.0.1:{port}/metrics{'; dry run: changes nothing' if settings.planner_dry_run else ''})",
          flush=True)
    asyncio.run(_run(settings, metrics, profile))
    return 0


async def _run(settings: PlannerSettings, metrics: PlannerMetrics, profile: DeploymentProfile | None) -> None:
    async with httpx.AsyncClient(timeout=10.0) as client:
        await Planner(settings, client, metrics, profile).run()


async def _save_profile(url: str, output: Path) -> int:
    async with httpx.AsyncClient(timeout=10.0) as client:
        profile = await fetch_profile(client, url)
    if profile is None:
        raise ValueError(f"{url} has no load calibration: start it with --calibrate-load")
    profile.save(output)
    print(f"pdserve planner profile: {output}: {profile}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
